"""``--sweep nodes``: the same model on 1..N nodes, against linear scaling."""

from __future__ import annotations

from typing import Any

from raycluster_cli.bench import experiment
from raycluster_cli.bench.planning import scaling_efficiency
from raycluster_cli.node import stage_worker as pipeline
from raycluster_cli.placement import memory


def sweep_nodes(session: Any, ranges: list[list[tuple[int, int]]]) -> dict[str, Any]:
    """One stage worker per alive node (the main run's are stopped first), 1..N of them in a pipeline."""
    o, cfg = session.options, session.cfg
    nodes = [n for n in session.nodes if not any(n["node_ip"] == lost["node_ip"] for lost in session.lost)]
    pipeline.stop_workers(session.workers)
    session.workers = []
    workers = pipeline.start_workers(
        cfg, [n["node_id"] for n in nodes], num_threads=o.threads, gpu_nodes=session.gpu_nodes
    )
    session.extra_workers = workers
    decode_steps = max(1, o.max_new_tokens - 1)
    for node, worker in zip(nodes, workers, strict=True):
        if node["node_id"] not in session.costs:  # held no stage of the main run: measure it now
            [cal] = pipeline.calibrate_workers(
                [worker], o.micro_batch, o.prompt_len, decode_steps, prefill_chunk=o.prefill_chunk
            )
            session.costs[node["node_id"]] = pipeline.unit_cost_row(cal, cfg.layers)
    which = "even" if o.partition.startswith("manual:") else o.partition
    points, skipped = [], []
    plan = session.memory
    for n in range(1, min(len(workers), cfg.layers) + 1):
        ids = [nodes[i]["node_id"] for i in range(n)]
        rows = [session.costs[node_id] for node_id in ids]
        transfer = session.transfer_s if n > 1 else 0.0
        try:
            if plan and which == "balanced":
                split = [plan.balanced(rows, transfer, ids)]
            else:
                split = [experiment.choose_ranges(which, rows, cfg.layers, transfer)]
        except memory.ModelTooLarge as exc:
            skipped.append({"nodes": n, "skipped": str(exc)})
            continue
        why = plan.why_not(split[0], ids) if plan else None
        if why:
            skipped.append({"nodes": n, "skipped": why})
            continue
        s = session.measure(split, session.params, f"sweep: {n} node(s)", replicas=[workers[:n]]).summary()
        points.append(
            {
                "nodes": n,
                "node_ips": [nodes[i]["node_ip"] for i in range(n)],
                "partition_ranges": [list(r) for r in split[0]],
                "tokens_per_s": s["tokens_per_s"],
                "imbalance": s["imbalance"],
                "latency_s": s["latency_s"],
            }
        )
    for point, eff in zip(points, scaling_efficiency([p["tokens_per_s"] for p in points]), strict=True):
        point["efficiency"] = eff
    return {"kind": "nodes", "partition": which, "points": points, "skipped": skipped}
