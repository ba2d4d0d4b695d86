"""One benchmark invocation: place the workers, calibrate, partition, run, and measure the references.

``run(args)`` is what ``python -m raycluster_cli.bench.driver`` executes inside the head container;
it returns the JSON-ready result document.  The order is fixed: calibrate every node (per unit
type, median of repeats), measure a stage boundary with no-op stages, choose each replica's split,
run the workload, then the references of the same run (the even split, the whole model unsharded
on the fastest node) and any sweep.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import math
import time
from typing import Any

SCHEMA_VERSION = 1
log = logging.getLogger("raycluster.bench")


def _ip_key(ip: str) -> tuple[int, Any]:
    try:
        return (0, ipaddress.ip_address(ip))
    except ValueError:
        return (1, ip)


def alive_nodes() -> list[dict[str, Any]]:
    """Alive Ray nodes as ``{"node_id", "node_ip", "gpus"}``, sorted by IP (then id)."""
    import ray

    nodes = [
        {
            "node_id": str(n["NodeID"]),
            "node_ip": str(n.get("NodeManagerAddress", "")),
            "gpus": float(n.get("Resources", {}).get("GPU", 0.0)),
        }
        for n in ray.nodes()
        if n.get("Alive")
    ]
    nodes.sort(key=lambda n: (_ip_key(str(n["node_ip"])), str(n["node_id"])))
    return nodes


def model_config(args: argparse.Namespace) -> Any:
    from raycluster_cli.bench.model import ModelConfig, config_from_checkpoint

    max_seq = args.max_seq or args.prompt_len + args.max_new_tokens
    if args.model_path:
        return config_from_checkpoint(args.model_path, max_seq, args.seed)
    return ModelConfig(
        vocab=args.vocab, d_model=args.d_model, heads=args.heads, layers=args.layers, max_seq=max_seq, seed=args.seed
    )


def bench_params(args: argparse.Namespace) -> Any:
    from raycluster_cli.bench.runtime import BenchParams

    if args.mode == "offline" and args.rate is not None:
        raise ValueError("--rate needs --mode poisson (or leave --mode out)")
    if args.mode == "poisson" and args.rate is None:
        raise ValueError("--mode poisson needs --rate R (requests per second)")
    return BenchParams(
        requests=args.requests,
        prompt_len=args.prompt_len,
        max_new_tokens=args.max_new_tokens,
        micro_batch=args.micro_batch,
        seed=args.seed,
        in_flight=args.in_flight,
        rate=args.rate,
        prefill_chunk=args.prefill_chunk,
    )


def choose_ranges(spec: str, cost_rows: list[list[float]], num_blocks: int, transfer_s: float) -> list[tuple[int, int]]:
    """The split of one replica: even, manual:…, or balanced on its nodes' measured unit costs."""
    from raycluster_cli.bench import partition

    stages = len(cost_rows)
    if spec == "even":
        return partition.even_partition(num_blocks, stages)
    if spec.startswith("manual:"):
        ranges = partition.manual_partition(spec[len("manual:") :], num_blocks)
        if len(ranges) != stages:
            raise ValueError(f"manual partition has {len(ranges)} stages but {stages} were asked for")
        return ranges
    return partition.balanced_partition(cost_rows, fixed_cost=partition.boundary_costs(transfer_s, stages))


def _check_spec(spec: str, num_blocks: int) -> None:
    from raycluster_cli.bench import partition

    if spec not in ("even", "balanced") and not spec.startswith("manual:"):
        raise ValueError(f"--partition must be even, balanced or manual:N,N,..., got {spec!r}")
    if spec.startswith("manual:"):
        partition.manual_partition(spec[len("manual:") :], num_blocks)


def _with_predictions(
    stages: list[dict[str, Any]], costs: dict[str, list[float]], replicas: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    from raycluster_cli.bench.scheduling import predicted_busy

    batches = {r["index"]: r["micro_batches"] for r in replicas}
    for stage in stages:
        row = costs.get(stage["node_id"])
        start, end = stage["units"]
        stage["predicted_s"] = predicted_busy(row, start, end, batches[stage["replica"]]) if row else None
    return stages


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    import torch

    from raycluster_cli.bench import pipeline, runtime, scheduling
    from raycluster_cli.bench.model import prefill_chunks

    cfg = model_config(args)
    params = bench_params(args)
    params.validate(cfg)
    spec = str(args.partition)
    _check_spec(spec, cfg.layers)
    started = time.perf_counter()
    if not ray.is_initialized():  # tests may hand over a Ray they started themselves
        ray.init(address="auto", logging_level=logging.ERROR, log_to_driver=False)
    nodes = alive_nodes()
    manual_stages = len(spec.split(",")) if spec.startswith("manual:") else None
    num_stages = args.stages or manual_stages or len(nodes)
    if num_stages > cfg.layers:
        raise ValueError(f"{num_stages} stages but the model has {cfg.layers} blocks: every stage needs one")
    plan = scheduling.plan_replicas(len(nodes), num_stages, args.replicas, args.allow_shared_nodes)
    gpu_nodes = {n["node_id"] for n in nodes if n["gpus"] >= 1}
    node_ids = [nodes[i]["node_id"] for replica in plan for i in replica]
    log.info("replicas on %s", [[nodes[i]["node_ip"] for i in replica] for replica in plan])
    flat = pipeline.start_workers(
        cfg, node_ids, num_threads=args.threads, allow_shared_nodes=args.allow_shared_nodes, gpu_nodes=gpu_nodes
    )
    replicas = [flat[r * num_stages : (r + 1) * num_stages] for r in range(len(plan))]
    doc: dict[str, Any] = {}
    try:
        # One worker per distinct node measures that node's speed.
        first_on_node: dict[str, Any] = {}
        for node_id, worker in zip(node_ids, flat, strict=True):
            first_on_node.setdefault(node_id, worker)
        decode_steps = max(1, params.max_new_tokens - 1)
        calibrations = dict(
            zip(
                first_on_node,
                pipeline.calibrate_workers(
                    list(first_on_node.values()),
                    params.micro_batch,
                    params.prompt_len,
                    decode_steps,
                    args.calibration_repeats,
                    args.calibration_sample_s,
                    params.prefill_chunk,
                ),
                strict=True,
            )
        )
        costs = {nid: pipeline.unit_cost_row(c, cfg.layers) for nid, c in calibrations.items()}
        chunks = prefill_chunks(params.prompt_len, params.prefill_chunk)
        hop_prefill = pipeline.hop_overhead(replicas[0], torch.zeros(params.micro_batch, chunks[0][1], cfg.d_model))
        hop_decode = pipeline.hop_overhead(replicas[0], torch.zeros(params.micro_batch, 1, cfg.d_model))
        transfer_s = len(chunks) * hop_prefill["per_hop_s"] + decode_steps * hop_decode["per_hop_s"]

        def ranges_for(which: str, group: list[list[Any]]) -> list[list[tuple[int, int]]]:
            out = []
            for r in range(len(group)):
                rows = [costs[node_ids[r * num_stages + s]] for s in range(num_stages)]
                out.append(choose_ranges(which, rows, cfg.layers, transfer_s))
            return out

        def measure(group: list[list[Any]], ranges: list[list[tuple[int, int]]], p: Any) -> Any:
            runtime.setup_replicas(group, ranges)
            return runtime.run_workload(group, ranges, cfg, p)

        ranges = ranges_for(spec, replicas)
        refinements: list[dict[str, Any]] = []
        if spec == "balanced" and args.refine:
            # Pilots run the counted workload offline, whole: a shorter pilot measured each node
            # ±10 % off the counted run on the lab, which is more than one block is worth.
            pilot_params = dataclasses.replace(params, rate=None)
            ranges, refinements = _refine(
                ranges,
                args.refine,
                lambda rr: measure(replicas, rr, pilot_params),
                costs,
                lambda: ranges_for(spec, replicas),
            )
            for entry in refinements:
                for key in ("factors", "mean_factors"):
                    entry[key] = {calibrations[nid]["node_ip"]: f for nid, f in entry[key].items()}
        result = measure(replicas, ranges, params)
        doc = {
            **result.summary(),
            "stages": _with_predictions(result.stage_dicts(), costs, result.replica_dicts()),
            "replicas": result.replica_dicts(),
            "partition_ranges": [[list(r) for r in rr] for rr in ranges],
        }
        if args.check_output:
            doc["output_check"] = runtime.check_output(cfg, params, result, args.check_requests)
        busiest = [r.busiest_s for r in result.replicas]
        ceiling = scheduling.ceiling_tokens_per_s([r.tokens for r in result.replicas], busiest)
        bottleneck = max(doc["stages"], key=lambda s: s["busy_s"])
        references: dict[str, Any] = {
            "ceiling": {
                "tokens_per_s": ceiling,
                "ratio": result.tokens_per_s / ceiling if ceiling else None,
                "gap": scheduling.ceiling_gap(result.wall_s, bottleneck),
            }
        }
        if args.references:
            if spec != "even":
                even_ranges = ranges_for("even", replicas)
                even = measure(replicas, even_ranges, params)
                references["even"] = _reference(result, even, {"partition_ranges": [list(r) for r in even_ranges[0]]})
            fastest = min(first_on_node, key=lambda nid: sum(costs[nid]))
            solo = [[first_on_node[fastest]]]
            whole = measure(solo, [[(0, cfg.num_units)]], params)
            references["unsharded"] = _reference(result, whole, {"node_ip": calibrations[fastest]["node_ip"]})
        doc["references"] = references
        if args.sweep == "batch":
            doc["sweep"] = _sweep_batch(replicas, ranges, params, measure, args.sweep_max_batch)
        elif args.sweep == "nodes":
            pipeline.stop_workers(flat)
            flat = pipeline.start_workers(
                cfg, [n["node_id"] for n in nodes], num_threads=args.threads, gpu_nodes=gpu_nodes
            )
            doc["sweep"] = _sweep_nodes(flat, nodes, spec, costs, cfg, params, transfer_s, measure)
    finally:
        pipeline.stop_workers(flat)

    doc.update(
        {
            "calibration": {
                "nodes": list(calibrations.values()),
                "refinements": refinements,
                "transfer_s_per_micro_batch": transfer_s,
            },
            "hop_overhead": {"prefill": hop_prefill, "decode": hop_decode, "per_hop_s": hop_decode["per_hop_s"]},
            "total_s": time.perf_counter() - started,
        }
    )
    doc["config"] = {
        "model": cfg.to_dict(),
        "model_source": f"{cfg.arch}:{cfg.model_path}" if cfg.model_path else "random",
        "mode": "poisson" if params.rate is not None else "offline",
        "rate": params.rate,
        "requests": params.requests,
        "prompt_len": params.prompt_len,
        "max_new_tokens": params.max_new_tokens,
        "micro_batch": params.micro_batch,
        "prefill_chunk": params.prefill_chunk,
        "seed": params.seed,
        "stages": num_stages,
        "replicas": len(plan),
        "partition": spec,
        "partition_ranges": doc["partition_ranges"][0],
        "threads": args.threads,
        "allow_shared_nodes": bool(args.allow_shared_nodes),
        "alive_nodes": len(nodes),
        "calibration_repeats": args.calibration_repeats,
        "calibration_sample_s": args.calibration_sample_s,
        "refine": args.refine if spec == "balanced" else 0,
        "latency_origin": "request_arrival",
        "warmup": "one micro-batch per replica, not counted",
    }
    return {"schema_version": SCHEMA_VERSION, "ok": True, **doc}


def _refine(
    ranges: list[list[tuple[int, int]]],
    pilots: int,
    run_pilot: Any,
    costs: dict[str, list[float]],
    solve: Any,
) -> tuple[list[list[tuple[int, int]]], list[dict[str, Any]]]:
    """Pilot runs that correct the calibration; returns the split to use and what each pilot saw.

    Each pilot runs the current split and measures, for every node, how its stage's time compares
    with what the calibration predicted (``_pilot_factors``).  The node's costs become the
    calibration times the geometric mean of its factors over *all* pilots so far, and the split is
    solved again.  Averaging is what makes this converge on a noisy machine: on the 2-core lab one
    run measures a node ±10 % off the next, and a correction from the last pilot alone chased that
    noise from split to split.  It stops early when the last two pilots measured the same split and
    the averaged costs still give it back.  The split used is the one solved from the averaged
    costs, measured or not.
    """
    calibrated = {nid: list(row) for nid, row in costs.items()}
    history: dict[str, list[float]] = {}
    tried: list[dict[str, Any]] = []
    for _ in range(pilots):
        pilot = run_pilot(ranges)
        summary = pilot.summary()
        factors = _pilot_factors(calibrated, pilot)
        for nid, factor in factors.items():
            history.setdefault(nid, []).append(factor)
        for nid, values in history.items():
            costs[nid] = [c * _geomean(values) for c in calibrated[nid]]
        tried.append(
            {
                "ranges": ranges,
                "partition_ranges": [list(r) for r in ranges[0]],
                "tokens_per_s": summary["tokens_per_s"],
                "imbalance": summary["imbalance"],
                "imbalance_capacity": summary.get("imbalance_capacity"),
                "busy_s": [s.busy_s for s in pilot.stages],
                "capacity_s": [s.capacity_s for s in pilot.stages],
                "factors": factors,
                "mean_factors": {nid: _geomean(values) for nid, values in history.items()},
            }
        )
        ranges = solve()
        if len(tried) >= 2 and ranges == tried[-1]["ranges"] == tried[-2]["ranges"]:
            break  # measured twice and still the answer: more pilots would only repeat it
    for t in tried:
        t["chosen"] = t["ranges"] == ranges
    return ranges, [{k: v for k, v in t.items() if k != "ranges"} for t in tried]


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _pilot_factors(calibrated: dict[str, list[float]], pilot: Any) -> dict[str, float]:
    """Each node's measured / predicted time of its stages in a pilot run, against the calibration.

    Calibration times each node alone; in the pipeline a node also runs Ray's own processes (the
    head: the driver and the GCS) and competes with its neighbours for the physical cores.  The
    pilot's times include all that.  The measured time is the stage's capacity time
    (``metrics.capacity_time``: busy time, or CPU time / CPU quota when larger), so a stage that
    waits for work and computes in unthrottled bursts under its quota is not mistaken for a fast node.
    """
    from raycluster_cli.bench.scheduling import predicted_busy

    per_node: dict[str, list[float]] = {}
    batches = {r.index: r.micro_batches for r in pilot.replicas}
    for stage in pilot.stages:
        predicted = predicted_busy(calibrated[stage.node_id], stage.units[0], stage.units[1], batches[stage.replica])
        if predicted > 0 and stage.capacity_s > 0:
            per_node.setdefault(stage.node_id, []).append(stage.capacity_s / predicted)
    return {nid: _geomean(values) for nid, values in per_node.items()}


def _reference(main: Any, ref: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """A reference run of the same workload: its numbers and main tokens/s as a ratio of its tokens/s."""
    summary = ref.summary()
    return {
        "tokens_per_s": summary["tokens_per_s"],
        "ratio": main.tokens_per_s / summary["tokens_per_s"] if summary["tokens_per_s"] else None,
        "imbalance": summary["imbalance"],
        "imbalance_capacity": summary["imbalance_capacity"],
        "wall_s": summary["wall_s"],
        "busy_s": [s.busy_s for s in ref.stages],
        "capacity_s": [s.capacity_s for s in ref.stages],
        **extra,
    }


def _sweep_batch(
    replicas: list[list[Any]], ranges: Any, params: Any, measure: Any, largest: int | None
) -> dict[str, Any]:
    from raycluster_cli.bench.scheduling import batch_sizes

    points = []
    for size in batch_sizes(params.requests, largest):
        result = measure(replicas, ranges, dataclasses.replace(params, micro_batch=size))
        s = result.summary()
        points.append(
            {
                "micro_batch": size,
                "tokens_per_s": s["tokens_per_s"],
                "requests_per_s": s["requests_per_s"],
                "imbalance": s["imbalance"],
                "latency_s": s["latency_s"],
            }
        )
    best = max(points, key=lambda p: p["tokens_per_s"])
    return {"kind": "batch", "points": points, "best_micro_batch": best["micro_batch"]}


def _sweep_nodes(
    workers: list[Any],
    nodes: list[dict[str, Any]],
    spec: str,
    costs: dict[str, list[float]],
    cfg: Any,
    params: Any,
    transfer_s: float,
    measure: Any,
) -> dict[str, Any]:

    from raycluster_cli.bench import pipeline
    from raycluster_cli.bench.scheduling import scaling_efficiency

    missing = [i for i, n in enumerate(nodes) if n["node_id"] not in costs]
    if missing:  # nodes that held no stage of the main run: measure them now
        decode_steps = max(1, params.max_new_tokens - 1)
        for i in missing:
            [cal] = pipeline.calibrate_workers(
                [workers[i]], params.micro_batch, params.prompt_len, decode_steps, prefill_chunk=params.prefill_chunk
            )
            costs[nodes[i]["node_id"]] = pipeline.unit_cost_row(cal, cfg.layers)
    which = "even" if spec.startswith("manual:") else spec
    points = []
    for n in range(1, min(len(workers), cfg.layers) + 1):
        rows = [costs[nodes[i]["node_id"]] for i in range(n)]
        ranges = [choose_ranges(which, rows, cfg.layers, transfer_s if n > 1 else 0.0)]
        result = measure([workers[:n]], ranges, params)
        s = result.summary()
        points.append(
            {
                "nodes": n,
                "node_ips": [nodes[i]["node_ip"] for i in range(n)],
                "partition_ranges": [list(r) for r in ranges[0]],
                "tokens_per_s": s["tokens_per_s"],
                "imbalance": s["imbalance"],
                "latency_s": s["latency_s"],
            }
        )
    for point, eff in zip(points, scaling_efficiency([p["tokens_per_s"] for p in points]), strict=True):
        point["efficiency"] = eff
    return {"kind": "nodes", "partition": which, "points": points}
