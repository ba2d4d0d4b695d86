"""The Ray-node runtime both the benchmark and the service use: node queries, rooms, cgroups, calibration, the stage links, GC pausing; imports models and placement."""
