"""Ray runtime of the benchmark: one stage actor per node, micro-batches streamed through them.

The driver only submits work and collects next-token ids: every step of a micro-batch is a chain
``stage0.forward -> stage1.forward -> ...`` of actor calls whose arguments are the previous call's
ObjectRef, so activations move node to node through Ray's object store, never through the driver.
Several micro-batches are kept in flight (at least one per stage) so every stage has work while
the others compute; ``ray.wait`` advances whichever micro-batch finished its step first.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycluster_cli.bench.model import ModelConfig, Stage, full_model_stage, greedy_generate
from raycluster_cli.bench.partition import blocks_held

WARMUP_CACHE_ID = -1
# Idle OpenMP threads sleep instead of spinning: several stages may share a machine's cores (a lab on
# one host, other tenants), and spinning threads of one stage then steal the CPU of the next.
WORKER_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def _node_entry(node_id: str) -> dict[str, Any]:
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return dict(node)
    return {}


def node_ip(node_id: str) -> str:
    """The IP the node registered with (what the driver sorts by), else this process's own guess.

    ``ray.util.get_node_ip_address()`` inside a worker may pick the default-route interface
    rather than the ``--node-ip-address`` the node was started with, so the node table wins.
    """
    return str(_node_entry(node_id).get("NodeManagerAddress") or ray.util.get_node_ip_address())


def node_cpu_count(node_id: str) -> int:
    """CPUs Ray advertises for ``node_id``, capped by the CPUs this process may run on."""
    advertised = float(_node_entry(node_id).get("Resources", {}).get("CPU", 0.0))
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(int(advertised) or usable, usable))


class _StageWorker:
    """Holds one Stage on one node and times its compute (busy time excludes queueing and transfer)."""

    def __init__(self, cfg: dict[str, int], num_threads: int | None = None) -> None:
        self.cfg = ModelConfig.from_dict(cfg)
        self.node_id: str = ray.get_runtime_context().get_node_id()
        self.node_ip = node_ip(self.node_id)
        self.num_threads = num_threads if num_threads else node_cpu_count(self.node_id)
        torch.set_num_threads(self.num_threads)
        self.stage: Stage | None = None
        self.busy_s = 0.0
        self.calls = 0

    def setup(self, start: int, end: int) -> dict[str, Any]:
        """Build units [start, end) (weights are local and deterministic, nothing is shipped)."""
        self.stage = Stage(self.cfg, start, end, emit="tokens")
        self.reset_stats()
        return {"units": [start, end], "layers": self.stage.num_blocks}

    def forward(self, cache_id: int, x: torch.Tensor, positions: int) -> torch.Tensor:
        if self.stage is None:
            raise RuntimeError("StageWorker.forward called before setup()")
        began = time.perf_counter()
        out = self.stage(x, cache_id, positions)
        self.busy_s += time.perf_counter() - began
        self.calls += 1
        return out

    def release(self, cache_id: int) -> bool:
        return self.stage.release(cache_id) if self.stage is not None else False

    def stats(self) -> dict[str, float | int]:
        cached = len(self.stage.cached_ids()) if self.stage is not None else 0
        return {"busy_s": self.busy_s, "calls": self.calls, "cached_micro_batches": cached}

    def reset_stats(self) -> None:
        self.busy_s = 0.0
        self.calls = 0

    def node_info(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "num_threads": self.num_threads,
            "pid": os.getpid(),
        }

    def calibrate(self, batch: int, prompt_len: int, decode_steps: int, repeats: int = 2) -> list[float]:
        """Seconds one micro-batch (prefill + decode steps) spends in each unit on this node.

        Times one embedding, one block and the head once each (best of ``repeats`` after a warm-up)
        and returns a cost for every unit 0..L+1, all blocks being the same shape.
        """
        cfg = self.cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        ids = torch.randint(0, cfg.vocab, (batch, prompt_len), generator=gen)
        hidden = torch.randn(batch, prompt_len, cfg.d_model, generator=gen)

        def timed(stage: Stage, first: torch.Tensor, step: torch.Tensor) -> float:
            best = float("inf")
            for _ in range(repeats + 1):  # first round is a warm-up
                began = time.perf_counter()
                stage(first, "calibrate", 0)
                for i in range(decode_steps):
                    stage(step, "calibrate", prompt_len + i)
                best = min(best, time.perf_counter() - began)
            stage.release("calibrate")
            return best

        emb = timed(Stage(cfg, 0, 1), ids, ids[:, :1])
        block = timed(Stage(cfg, 1, 2), hidden, hidden[:, :1])
        head = timed(Stage(cfg, cfg.head_unit, cfg.num_units), hidden, hidden[:, :1])
        return [emb, *([block] * cfg.layers), head]


StageWorker = ray.remote(num_cpus=0)(_StageWorker)


@dataclass
class BenchParams:
    requests: int = 32
    prompt_len: int = 32
    max_new_tokens: int = 16
    micro_batch: int = 4
    seed: int = 0
    in_flight: int | None = None  # micro-batches in flight; default and minimum: stages + 1
    warmup: bool = True

    def validate(self, cfg: ModelConfig) -> None:
        for name in ("requests", "prompt_len", "max_new_tokens", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_len + self.max_new_tokens - 1 > cfg.max_seq:
            raise ValueError(
                f"prompt_len + max_new_tokens - 1 = {self.prompt_len + self.max_new_tokens - 1} "
                f"exceeds max_seq={cfg.max_seq}"
            )


@dataclass
class StageReport:
    index: int
    node_ip: str
    node_id: str
    units: list[int]
    layers: int
    has_embedding: bool
    has_head: bool
    busy_s: float
    calls: int
    num_threads: int


@dataclass
class PipelineResult:
    requests: int
    completed: int
    generated_tokens: int
    wall_s: float
    in_flight: int
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)  # per request, in request order
    stages: list[StageReport] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.completed / self.wall_s if self.wall_s > 0 else 0.0

    def stage_dicts(self) -> list[dict[str, Any]]:
        return [asdict(s) for s in self.stages]


def make_prompts(vocab: int, requests: int, prompt_len: int, seed: int) -> torch.Tensor:
    """The benchmark's random prompts, int64 [requests, prompt_len], reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, vocab, size=(requests, prompt_len), dtype=np.int64))


def micro_batches(requests: int, micro_batch: int) -> list[range]:
    return [range(i, min(i + micro_batch, requests)) for i in range(0, requests, micro_batch)]


def start_workers(
    cfg: ModelConfig,
    node_ids: list[str],
    *,
    num_threads: int | None = None,
    allow_shared_nodes: bool = False,
) -> list[Any]:
    """One StageWorker per entry of ``node_ids``, hard-pinned to that node, in stage order.

    Stages normally each get their own node; ``allow_shared_nodes`` lets a node appear several
    times (single-machine tests).  Returns once every actor is up.
    """
    if not node_ids:
        raise ValueError("need at least one node for the pipeline")
    if not allow_shared_nodes and len(set(node_ids)) != len(node_ids):
        raise ValueError("each stage needs its own node (pass allow_shared_nodes to repeat a node)")
    workers: list[Any] = [
        StageWorker.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            runtime_env={"env_vars": dict(WORKER_ENV)},
        ).remote(cfg.to_dict(), num_threads)
        for node_id in node_ids
    ]
    ray.get([w.node_info.remote() for w in workers])
    return workers


def stop_workers(workers: list[Any]) -> None:
    for w in workers:
        ray.kill(w)


def calibrate_workers(workers: list[Any], params: BenchParams) -> list[list[float]]:
    """Per-unit costs measured on each worker's node, one after the other so they don't compete."""
    return [
        ray.get(w.calibrate.remote(params.micro_batch, params.prompt_len, max(1, params.max_new_tokens - 1)))
        for w in workers
    ]


def _submit_step(workers: list[Any], cache_id: int, x: Any, position: int) -> Any:
    ref = x
    for w in workers:
        ref = w.forward.remote(cache_id, ref, position)
    return ref


def _warm_up(workers: list[Any], prompts: torch.Tensor, decode_steps: int) -> None:
    """Prefill + a few decode steps of one micro-batch so lazy init and allocators are out of the way."""
    tokens = ray.get(_submit_step(workers, WARMUP_CACHE_ID, prompts, 0))
    position = prompts.shape[1]
    for _ in range(decode_steps):
        tokens = ray.get(_submit_step(workers, WARMUP_CACHE_ID, tokens[:, None], position))
        position += 1
    ray.get([w.release.remote(WARMUP_CACHE_ID) for w in workers])


def run_pipeline(
    workers: list[Any], ranges: list[tuple[int, int]], cfg: ModelConfig, params: BenchParams
) -> PipelineResult:
    """Build the stages on ``workers`` and stream ``params.requests`` greedy generations through them.

    TTFT and end-to-end latency are measured from the moment a request's micro-batch is admitted
    into the pipeline (all requests are queued at the start; this is an offline throughput run).
    """
    params.validate(cfg)
    if len(ranges) != len(workers):
        raise ValueError(f"{len(ranges)} stage ranges for {len(workers)} workers")
    ray.get([w.setup.remote(start, end) for w, (start, end) in zip(workers, ranges, strict=True)])
    infos = ray.get([w.node_info.remote() for w in workers])
    prompts = make_prompts(cfg.vocab, params.requests, params.prompt_len, params.seed)
    batches = micro_batches(params.requests, params.micro_batch)
    if params.warmup:
        _warm_up(workers, prompts[batches[0].start : batches[0].stop], min(2, params.max_new_tokens - 1))
    ray.get([w.reset_stats.remote() for w in workers])

    in_flight = max(params.in_flight or 0, len(workers) + 1)
    tokens: list[list[int]] = [[] for _ in range(params.requests)]
    ttft = [0.0] * params.requests
    e2e = [0.0] * params.requests
    admitted_at: dict[int, float] = {}
    position: dict[int, int] = {}
    pending: dict[Any, int] = {}
    releases: list[Any] = []
    next_batch = 0
    completed = 0
    began = time.perf_counter()

    def admit() -> None:
        nonlocal next_batch
        while next_batch < len(batches) and len(admitted_at) < in_flight:
            mb = next_batch
            next_batch += 1
            admitted_at[mb] = time.perf_counter()
            position[mb] = 0
            rows = batches[mb]
            pending[_submit_step(workers, mb, prompts[rows.start : rows.stop], 0)] = mb

    admit()
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        mb = pending.pop(ready[0])
        step_tokens: torch.Tensor = ray.get(ready[0])
        now = time.perf_counter()
        rows = batches[mb]
        for row, tok in zip(rows, step_tokens.tolist(), strict=True):
            tokens[row].append(int(tok))
            if len(tokens[row]) == 1:
                ttft[row] = now - admitted_at[mb]
        position[mb] += params.prompt_len if position[mb] == 0 else 1
        if len(tokens[rows.start]) < params.max_new_tokens:
            pending[_submit_step(workers, mb, step_tokens[:, None], position[mb])] = mb
            continue
        for row in rows:
            e2e[row] = now - admitted_at[mb]
        completed += len(rows)
        releases.extend(w.release.remote(mb) for w in workers)
        del admitted_at[mb]
        admit()
    wall_s = time.perf_counter() - began
    ray.get(releases)

    stats = ray.get([w.stats.remote() for w in workers])
    stages = [
        StageReport(
            index=i,
            node_ip=str(info["node_ip"]),
            node_id=str(info["node_id"]),
            units=[start, end],
            layers=blocks_held(start, end, cfg.layers),
            has_embedding=start == 0,
            has_head=end == cfg.num_units,
            busy_s=float(stat["busy_s"]),
            calls=int(stat["calls"]),
            num_threads=int(info["num_threads"]),
        )
        for i, (info, stat, (start, end)) in enumerate(zip(infos, stats, ranges, strict=True))
    ]
    return PipelineResult(
        requests=params.requests,
        completed=completed,
        generated_tokens=sum(len(t) for t in tokens),
        wall_s=wall_s,
        in_flight=in_flight,
        ttft_s=ttft,
        e2e_s=e2e,
        tokens=tokens,
        stages=stages,
    )


def reference_tokens(cfg: ModelConfig, params: BenchParams, num_requests: int) -> list[list[int]]:
    """Greedy tokens of the first ``num_requests`` requests from the unsharded model, in this process.

    Uses the same micro-batch grouping as the pipeline so both sides run identically shaped matmuls.
    """
    prompts = make_prompts(cfg.vocab, params.requests, params.prompt_len, params.seed)
    model = full_model_stage(cfg, emit="tokens")
    out: list[list[int]] = []
    for rows in micro_batches(params.requests, params.micro_batch):
        if len(out) >= num_requests:
            break
        generated = greedy_generate([model], prompts[rows.start : rows.stop], params.max_new_tokens)
        out.extend(generated.tolist())
    return out[:num_requests]


def check_output(
    cfg: ModelConfig, params: BenchParams, result: PipelineResult, num_requests: int = 8
) -> dict[str, Any]:
    """Compare the pipeline's greedy tokens with the unsharded model's for a few requests."""
    n = max(1, min(num_requests, result.requests))
    expected = reference_tokens(cfg, params, n)
    return {"identical": expected == result.tokens[:n], "compared_requests": n}
