"""Ray side of the benchmark: one StageWorker actor per (replica, stage), pinned to its node.

Every step of a micro-batch is a chain ``stage0.forward -> stage1.forward -> ...`` of actor calls.
By default (``hops="driver"``) the driver chains the calls, each taking the previous call's
ObjectRef; small activations (decode steps, under 100 KiB) travel inline via their owner, the
driver.  With ``hops="direct"`` each stage holds the next stage's handle (``link``) and calls it
itself with its output, returning that call's ObjectRef, which the driver follows (``runtime.py``):
activations go stage to stage, but every returned reference is a nested one whose borrowing Ray
tracks with extra messages, and on the lab that cost more than the relay it saves (0.87x the
tokens/s of driver hops, docs/PERFORMANCE.md).  The no-op ``hop`` measures both ways in every run.  Each worker times its
own compute (busy time), measures its node's speed per unit type (``calibrate``, on the forward the service
runs) and offers a no-op ``hop`` to measure what a stage boundary costs without any compute.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Mapping
from typing import Any

import psutil
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycluster_cli.models.batched import BatchedStage, linears, measure_forms
from raycluster_cli.models.decoder import ModelConfig, Stage, seconds_per_pass
from raycluster_cli.models.matmuls import Matmuls, weight_bytes
from raycluster_cli.node.cgroup import (
    container_cpu_quota,
    container_cpu_usage,
    container_memory,
    node_capacity,
)
from raycluster_cli.node.nodes import (
    UNIT_TYPES,
    WORKER_ENV,
    gpu_shares,
    node_cpu_count,
    node_ip,
    peak_rss,
    pick_device,
)


def _shapes(cfg: ModelConfig) -> tuple[Any, ...]:
    """What a product form's measurement depends on in a model's config: everything but its depth."""
    return tuple(sorted((key, repr(value)) for key, value in cfg.to_dict().items() if key != "layers"))


class _Served:
    """Units [start, end) as the service runs them (``BatchedStage``: one KV slot per row, the product forms
    measured on this node), called as ``seconds_per_pass`` calls a bench ``Stage``: every row at ``start``, row b
    in slot b.  What ``calibrate`` times, so the placement of a service, the bench and the service's re-split
    start from the same numbers."""

    def __init__(self, cfg: ModelConfig, start: int, end: int, batch: int, device: str) -> None:
        room = (lambda: node_capacity("", "").usable) if device == "cpu" else None
        self.stage = BatchedStage(cfg, start, end, slots=batch, device=device, room_bytes=room)

    def __call__(self, x: torch.Tensor, key: Any, start: int) -> torch.Tensor:
        batch, steps = x.shape[0], x.shape[1]
        table = torch.tensor([list(range(batch)), [start] * batch, [steps] * batch], dtype=torch.long)
        return self.stage.forward(x, table)

    def release(self, key: Any) -> bool:
        """Nothing to free: the slots are overwritten by the next pass."""
        return True


class _StageWorker:
    """Holds one Stage on one node and times its compute (busy time excludes queueing and transfer)."""

    # What ``reset_stats`` starts afresh before each counted run.
    busy_s: float
    cpu_s: float
    calls: int
    cache_peak: int
    process_cpu_began: float
    container_cpu_began: float | None
    stats_began: float
    first_began: float | None
    last_ended: float
    intervals: list[tuple[float, float]]

    def __init__(self, cfg: dict[str, Any], num_threads: int | None = None) -> None:
        self.cfg = ModelConfig.from_dict(cfg)
        self.node_id: str = ray.get_runtime_context().get_node_id()
        self.node_ip = node_ip(self.node_id)
        self.num_threads = num_threads if num_threads else node_cpu_count(self.node_id)
        torch.set_num_threads(self.num_threads)
        self.device = pick_device()
        self.stage: Stage | None = None
        self.next: Any = None  # the next stage's handle (direct hops); None on the last stage
        # the product forms the last calibration measured: (the model's shapes, blocks', head's)
        self.forms: tuple[tuple[Any, ...], Matmuls, Matmuls] | None = None
        self.process = psutil.Process()
        self.reset_stats()

    def configure(self, cfg: dict[str, Any]) -> None:
        """Another model shape (``--layers`` sized after calibration); the next ``setup`` builds from it."""
        self.cfg = ModelConfig.from_dict(cfg)
        self.stage = None

    def process_cpu_s(self) -> float:
        """CPU seconds of this whole process so far (every thread: torch, Ray's own): the clock ``cpu_s`` sums its
        forwards' pieces of, so the part is never more than the whole (/proc's user + system, read by psutil, counts
        in ticks of 10 ms: on a short run the whole read less than its parts)."""
        return time.process_time()

    def setup(self, start: int, end: int) -> dict[str, Any]:
        """Build units [start, end): random weights are made here, real ones read from the local file."""
        self.stage = None  # free the previous stage first
        began = time.perf_counter()
        self.stage = Stage(self.cfg, start, end, emit="tokens", device=self.device)
        if self.stage.device.type == "cpu":
            self._set_forms(self.stage)
        self.reset_stats()
        return {
            "units": [start, end],
            "layers": self.stage.num_blocks,
            "load_s": time.perf_counter() - began,
            "matmuls": {"blocks": self.stage.mm.describe(), "head": self.stage.head_mm.describe()},
        }

    def _set_forms(self, stage: Stage) -> None:
        """The counted run multiplies as the service does and as ``calibrate`` timed: in the forms measured on
        this node (``models.matmuls``), the calibration's plan when it measured this model's shapes (measuring
        again costs seconds per run), packed copies only where the node has room for them."""
        spare = node_capacity("", "").usable // 2
        blocks, head = linears(stage)
        measured = self.forms if self.forms is not None and self.forms[0] == _shapes(self.cfg) else None
        if measured is None:
            stage.mm, stage.head_mm = measure_forms(stage, spare)
            return
        _, block_mm, head_mm = measured
        needs = (weight_bytes(blocks) if block_mm.uses_packed else 0) + (
            weight_bytes(head) if head_mm.uses_packed else 0
        )
        if needs > spare:
            stage.mm, stage.head_mm = measure_forms(stage, spare)
        else:
            stage.mm, stage.head_mm = block_mm.over(blocks), head_mm.over(head)

    def link(self, next_stage: Any) -> bool:
        """The stage this one sends its output to when called with ``onward`` (None: the last stage)."""
        self.next = next_stage
        return True

    def forward(self, cache_id: int, x: torch.Tensor, positions: int, onward: bool = False) -> Any:
        """This stage's units on ``x``; with ``onward``, the next stage's call on the output (its ObjectRef)."""
        if self.stage is None:
            raise RuntimeError("StageWorker.forward called before setup()")
        began, cpu_began = time.perf_counter(), time.process_time()
        out = self.stage(x, cache_id, positions)
        ended = time.perf_counter()
        self.busy_s += ended - began
        self.cpu_s += time.process_time() - cpu_began
        if self.first_began is None:
            self.first_began = began
        self.last_ended = ended
        self.intervals.append((began - self.stats_began, ended - self.stats_began))
        self.calls += 1
        if positions == 0:  # caches are allocated at prefill
            self.cache_peak = max(self.cache_peak, self.stage.cache_bytes())
        if onward and self.next is not None:
            return self.next.forward.remote(cache_id, out, positions, True)
        return out

    def hop(self, x: torch.Tensor, onward: bool = False) -> Any:
        """A no-op stage: what a stage boundary costs (scheduling, transfer) without compute."""
        if onward and self.next is not None:
            return self.next.hop.remote(x, True)
        return x

    def release(self, cache_id: int) -> bool:
        return self.stage.release(cache_id) if self.stage is not None else False

    def stats(self) -> dict[str, Any]:
        cached = len(self.stage.cached_ids()) if self.stage is not None else 0
        span = self.last_ended - self.first_began if self.first_began is not None else 0.0
        container = container_cpu_usage()
        began = self.container_cpu_began
        return {
            "container_cpu_s": container - began if container is not None and began is not None else None,
            "stats_wall_s": time.perf_counter() - self.stats_began,
            "busy_s": self.busy_s,
            "cpu_s": self.cpu_s,
            "process_cpu_s": self.process_cpu_s() - self.process_cpu_began,
            "span_s": span,
            "calls": self.calls,
            "cached_micro_batches": cached,
            "weights_bytes": self.stage.weight_bytes() if self.stage is not None else 0,
            "cache_peak_bytes": self.cache_peak,
            "memory": container_memory(),
            "process_peak_rss_bytes": peak_rss() if sys.platform == "linux" else self.process.memory_info().rss,
            # every forward's (start, end), seconds after reset_stats (the run's start, on this node's clock)
            "intervals": [(round(a, 5), round(b, 5)) for a, b in self.intervals],
        }

    def reset_stats(self) -> None:
        self.busy_s = 0.0
        self.cpu_s = 0.0
        self.calls = 0
        self.cache_peak = 0
        self.process_cpu_began = self.process_cpu_s()
        self.container_cpu_began = container_cpu_usage()
        self.stats_began = time.perf_counter()
        self.first_began = None
        self.last_ended = 0.0
        self.intervals = []

    def probe_dtypes(self, batch: int, prompt_len: int, decode_steps: int, min_sample_s: float) -> dict[str, Any]:
        """One block's seconds per micro-batch in float32 and in bfloat16 on this node (``precision``)."""
        from raycluster_cli.models import precision

        timed = {
            f"{dtype}_s": precision.block_seconds(
                self.cfg, dtype, self.device, batch, prompt_len, decode_steps, min_sample_s
            )
            for dtype in precision.PROBED
        }
        return {"node_ip": self.node_ip, **timed}

    def memory_capacity(self) -> dict[str, Any]:
        """What this node can still hold for a stage (``memory``), measured now."""
        return node_capacity(self.node_id, self.node_ip, self.device).to_dict()

    def node_info(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "num_threads": self.num_threads,
            "device": self.device,
            "pid": os.getpid(),
            "cpu_quota": container_cpu_quota(),
        }

    def calibrate(
        self,
        batch: int,
        prompt_len: int,
        decode_steps: int,
        repeats: int = 5,
        min_sample_s: float = 0.25,
        prefill_chunk: int = 0,
        max_blocks: int = 4,
    ) -> dict[str, Any]:
        """Seconds one micro-batch (prefill + decode steps) spends in each unit type on this node, in the
        forward the service runs (``_Served``).

        Embedding, block and head are timed in turn, ``repeats`` rounds after a warm-up round, and
        the median of each is kept (robust to a neighbour stealing the CPU for one round).  A block
        is timed as a run of up to 4 blocks divided by their number, for resolution.  Each sample
        repeats the pass until ``min_sample_s`` has elapsed: a container with a CPU quota runs at
        full speed until its quota for the scheduler period (100 ms) is spent and then stalls, so
        only samples spanning several periods see the node's sustained speed.  The prompt is fed
        in ``prefill_chunk`` pieces, as the run will feed it.
        """
        cfg = self.cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        ids = torch.randint(0, cfg.vocab, (batch, prompt_len), generator=gen)
        hidden = torch.randn(batch, prompt_len, cfg.d_model, generator=gen)
        run = max(1, min(4, max_blocks, cfg.layers))  # fewer where memory is short
        subjects = {
            "embedding": (_Served(cfg, 0, 1, batch, self.device), ids, 1),
            "block": (_Served(cfg, 1, 1 + run, batch, self.device), hidden, run),
            "head": (_Served(cfg, cfg.head_unit, cfg.num_units, batch, self.device), hidden, 1),
        }
        samples: dict[str, list[float]] = {kind: [] for kind in subjects}
        cpu: dict[str, list[float]] = {kind: [] for kind in subjects}
        for round_ in range(repeats + 1):  # round 0 is a warm-up
            for kind, (stage, first, units) in subjects.items():
                sample_s = min_sample_s if round_ else 0.0  # the warm-up: one pass
                wall, cpu_s = seconds_per_pass(stage, first, prompt_len, decode_steps, sample_s, "cal", prefill_chunk)
                if round_:
                    samples[kind].append(wall / units)
                    cpu[kind].append(cpu_s / units)
        if self.device == "cpu":  # the forms the counted runs then multiply in (``setup``)
            block, head = subjects["block"][0].stage, subjects["head"][0].stage
            self.forms = (_shapes(cfg), block.block_mm, head.head_mm)
        medians = {kind: statistics.median(values) for kind, values in samples.items()}
        spread = {kind: (max(v) - min(v)) / medians[kind] if medians[kind] else 0.0 for kind, v in samples.items()}
        return {
            "node_ip": self.node_ip,
            "repeats": repeats,
            **{f"{k}_s": medians[k] for k in UNIT_TYPES},
            **{f"{k}_cpu_s": statistics.median(cpu[k]) for k in UNIT_TYPES},  # for balance.capacity_costs
            "cpu_quota": container_cpu_quota(),
            "num_threads": self.num_threads,
            "device": self.device,
            "spread": spread,
        }


StageWorker = ray.remote(num_cpus=0)(_StageWorker)


def unit_cost_row(calibration: dict[str, Any], num_blocks: int) -> list[float]:
    """Cost of every unit 0..L+1 on one node from its per-type calibration."""
    return [
        float(calibration["embedding_s"]),
        *([float(calibration["block_s"])] * num_blocks),
        float(calibration["head_s"]),
    ]


def start_workers(
    cfg: ModelConfig,
    node_ids: list[str],
    *,
    num_threads: int | None = None,
    allow_shared_nodes: bool = False,
    gpu_nodes: set[str] | Mapping[str, float] | None = None,
) -> list[Any]:
    """One StageWorker per entry of ``node_ids``, hard-pinned to that node, in order.

    Stages normally each get their own node; ``allow_shared_nodes`` lets a node appear several
    times (single-machine tests).  On a node in ``gpu_nodes`` (a set: one GPU each; a mapping: the
    node's GPU count) the worker asks Ray for a GPU, so Ray makes it visible and the stage runs on
    ``cuda``; stages stacked on one node share its GPUs (``gpu_shares``: three stages on a one-GPU
    machine a third each, all on that GPU; whole GPUs would leave the second stage unscheduled for
    ever).  Returns once every actor is up.
    """
    if not node_ids:
        raise ValueError("need at least one node for the pipeline")
    if not allow_shared_nodes and len(set(node_ids)) != len(node_ids):
        raise ValueError("each stage needs its own node (pass allow_shared_nodes to repeat a node)")
    gpus = gpu_nodes if isinstance(gpu_nodes, Mapping) else dict.fromkeys(gpu_nodes or (), 1.0)
    workers: list[Any] = [
        StageWorker.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            runtime_env={"env_vars": dict(WORKER_ENV)},
            num_gpus=share,
        ).remote(cfg.to_dict(), num_threads)
        for node_id, share in zip(node_ids, gpu_shares(node_ids, gpus), strict=True)
    ]
    ray.get([w.node_info.remote() for w in workers])
    return workers


def stop_workers(workers: list[Any]) -> None:
    for w in workers:
        ray.kill(w)


def calibrate_workers(
    workers: list[Any],
    batch: int,
    prompt_len: int,
    decode_steps: int,
    repeats: int = 5,
    min_sample_s: float = 0.25,
    prefill_chunk: int = 0,
    max_blocks: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Per-unit-type costs measured on each worker's node, all nodes at once (at most ``max_blocks[i]``
    blocks built at once on worker i's node).

    At once, because that is how they run in the pipeline: nodes that share physical cores (a lab
    on one machine, noisy neighbours) are measured under the same contention they will meet.
    """
    return list(
        ray.get(
            [
                w.calibrate.remote(batch, prompt_len, decode_steps, repeats, min_sample_s, prefill_chunk, blocks)
                for w, blocks in zip(workers, max_blocks or [4] * len(workers), strict=True)
            ]
        )
    )


def link_stages(workers: list[Any]) -> None:
    """Each stage of one pipeline gets the next one's handle (direct hops)."""
    ray.get([w.link.remote(nxt) for w, nxt in zip(workers, [*workers[1:], None], strict=True)])


def resolve(ref: Any) -> Any:
    """The value at the end of a chain of references (direct hops return the next stage's ObjectRef)."""
    value = ray.get(ref)
    while isinstance(value, ray.ObjectRef):
        value = ray.get(value)
    return value


def _hop_round_trips(workers: list[Any], ref: Any, direct: bool, repeats: int) -> list[float]:
    times: list[float] = []
    for i in range(repeats + 2):  # two warm-up rounds
        began = time.perf_counter()
        if direct:
            resolve(workers[0].hop.remote(ref, True))
        else:
            out = ref
            for w in workers:
                out = w.hop.remote(out)
            ray.get(out)
        if i >= 2:
            times.append(time.perf_counter() - began)
    return times


def hop_overhead(workers: list[Any], payload: torch.Tensor, repeats: int = 20, hops: str = "driver") -> dict[str, Any]:
    """Median round trip of ``payload`` through the workers' no-op ``hop`` (one call per stage), both ways.

    ``per_hop_s`` is that median divided by the number of stages for ``hops`` (the way the run passes
    activations): what one stage boundary costs in scheduling and transfer, with no compute at all.
    The other way is measured in the same run, alternated round by round, as its reference.
    """
    link_stages(workers)
    ref = ray.put(payload)
    direct: list[float] = []
    driver: list[float] = []
    for _ in range(3):  # alternated: a neighbour's burst of load does not fall on one way only
        direct += _hop_round_trips(workers, ref, True, max(1, repeats // 3))
        driver += _hop_round_trips(workers, ref, False, max(1, repeats // 3))
    per_hop = {"direct": statistics.median(direct) / len(workers), "driver": statistics.median(driver) / len(workers)}
    median = statistics.median(direct if hops == "direct" else driver)
    return {
        "stages": len(workers),
        "payload_bytes": payload.numel() * payload.element_size(),
        "hops": hops,
        "round_trip_s": median,
        "per_hop_s": median / len(workers),
        "per_hop_direct_s": per_hop["direct"],
        "per_hop_via_driver_s": per_hop["driver"],
        "via_driver_over_direct": per_hop["driver"] / per_hop["direct"] if per_hop["direct"] > 0 else None,
    }
