"""The benchmark's decisions, pure where they can be: which nodes, how big a model, which split, how many
requests, and how a reference reads against the counted run. ``session.run`` drives one invocation with them.

The order of an invocation is fixed: calibrate every node (per
unit type, median of repeats); size the model (``--layers``: every node gets a share proportional to
its speed) and measure a stage boundary with no-op stages; pilots correct the calibration and size
the counted run (``--duration-s``); the even split gets a pilot of its own and is used instead when
it measured faster; then the counted run, the references of the same run (the other split, the whole
model unsharded on the fastest node) and any sweep.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

from raycluster_cli.bench.options import BenchOptions

log = logging.getLogger("raycluster.bench")
Report = Callable[..., None]
Ranges = list[list[tuple[int, int]]]

MAX_AUTO_LAYERS = 512
MIN_AUTO_LAYERS = 12


def model_config(options: BenchOptions, layers: int, on_gpu: bool = False, dtype: str | None = None) -> Any:
    """The run's model: ``dtype`` (a resolved one) wins over ``--dtype``, whose ``auto`` resolves with
    ``on_gpu`` (every stage node has a GPU) to the checkpoint's dtype, else to float32."""
    from raycluster_cli.models.decoder import ModelConfig, config_from_checkpoint, resolve_dtype

    max_seq = options.max_seq or options.prompt_len + options.max_new_tokens
    wanted = dtype or options.dtype
    if options.model_path:
        return config_from_checkpoint(options.model_path, max_seq, options.seed, dtype=wanted, on_gpu=on_gpu)
    return ModelConfig(
        dtype=resolve_dtype(wanted, "float32", on_gpu),
        vocab=options.vocab,
        d_model=options.d_model,
        heads=options.heads,
        layers=layers,
        max_seq=max_seq,
        seed=options.seed,
    )


def bench_params(options: BenchOptions, requests: int) -> Any:
    from raycluster_cli.bench.results import BenchParams

    return BenchParams(
        requests=requests,
        prompt_len=options.prompt_len,
        max_new_tokens=options.max_new_tokens,
        micro_batch=options.micro_batch,
        seed=options.seed,
        in_flight=options.in_flight,
        rate=options.rate,
        prefill_chunk=options.prefill_chunk,
        step_timeout_s=options.step_timeout_s,
        hops=options.hops,
    )


def choose_ranges(spec: str, cost_rows: list[list[float]], num_blocks: int, transfer_s: float) -> list[tuple[int, int]]:
    """The split of one replica: even, manual:…, or balanced on its nodes' measured unit costs."""
    from raycluster_cli.placement import partition

    stages = len(cost_rows)
    if spec == "even":
        return partition.even_partition(num_blocks, stages)
    if spec.startswith("manual:"):
        ranges = partition.manual_partition(spec[len("manual:") :], num_blocks)
        if len(ranges) != stages:
            raise ValueError(f"manual partition has {len(ranges)} stages but {stages} were asked for")
        return ranges
    return partition.balanced_partition(cost_rows, fixed_cost=partition.boundary_costs(transfer_s, stages))


def auto_layers(block_s_per_replica: list[list[float]], min_blocks: int) -> int:
    """Blocks enough that the slowest node of every replica holds ``min_blocks`` at its speed's share.

    A node at a quarter of the fastest one's speed should hold a quarter of its blocks; with 12
    blocks on nodes at 1 : 0.25 : 0.25 the split can only be 10/1/1 and the slow nodes cannot be
    given less than one whole block.
    """
    needed = MIN_AUTO_LAYERS
    for row in block_s_per_replica:
        speeds = [1.0 / max(b, 1e-9) for b in row]
        needed = max(needed, math.ceil(min_blocks * sum(speeds) / min(speeds)))
    return min(MAX_AUTO_LAYERS, needed)


def requests_for(duration_s: float, tokens_per_s: float, options: BenchOptions, least: int) -> int:
    """Requests that keep the pipeline busy for ``duration_s`` at ``tokens_per_s``, whole micro-batches."""
    batches = math.ceil(duration_s * tokens_per_s / (options.max_new_tokens * options.micro_batch))
    return max(least, batches * options.micro_batch)


def with_predictions(
    stages: list[dict[str, Any]], costs: dict[str, list[float]], replicas: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    from raycluster_cli.bench.planning import predicted_busy

    batches = {r["index"]: r["micro_batches"] for r in replicas}
    for stage in stages:
        row = costs.get(stage["node_id"])
        start, end = stage["units"]
        stage["predicted_s"] = predicted_busy(row, start, end, batches[stage["replica"]]) if row else None
    return stages


def reference(main: Any, ref: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """A reference run of the same workload: its numbers and main tokens/s as a ratio of its tokens/s."""
    summary = ref.summary()
    return {
        "tokens_per_s": summary["tokens_per_s"],
        "tokens_per_s_spread": summary["tokens_per_s_spread"],
        "ratio": main.tokens_per_s / summary["tokens_per_s"] if summary["tokens_per_s"] else None,
        "imbalance": summary["imbalance"],
        "imbalance_capacity": summary["imbalance_capacity"],
        "wall_s": summary["wall_s"],
        "busy_s": [s.busy_s for s in ref.stages],
        "capacity_s": [s.capacity_s for s in ref.stages],
        **extra,
    }


def sweep_batch(run_size: Callable[[int], Any], requests: int, largest: int | None) -> dict[str, Any]:
    from raycluster_cli.bench.planning import batch_sizes

    points = []
    for size in batch_sizes(requests, largest):
        s = run_size(size).summary()
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


def replace_params(params: Any, **changes: Any) -> Any:
    return dataclasses.replace(params, **changes)
