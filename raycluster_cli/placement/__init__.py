"""Where work goes: partitions, balance, memory maths, pipeline placement; pure Python (no torch, no Ray), imports models.config and the root only."""
