"""The driver's event loop: requests arrive, form micro-batches, are routed to a pipeline replica
and streamed through its stages until every request has its tokens.

Each replica keeps at least ``stages + 1`` micro-batches in flight so no stage waits for work it
could have; prefill and every decode step go through all stages.  A micro-batch is formed as soon
as a replica has room: up to ``micro_batch`` requests that have arrived (offline mode: all of them
arrived at 0, so batches are full; ``rate`` mode: Poisson arrivals, batches take what is waiting).
The replica is chosen by power of two choices on outstanding requests.  Latencies are measured from
each request's arrival.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import ray
import torch

from raycluster_cli.bench import metrics
from raycluster_cli.bench.model import ModelConfig, full_model_stage, greedy_generate, prefill_chunks
from raycluster_cli.bench.partition import blocks_held
from raycluster_cli.bench.scheduling import arrival_times, in_flight_limit, power_of_two_choice

WARMUP_CACHE_ID = -1


@dataclass
class BenchParams:
    requests: int = 32
    prompt_len: int = 32
    max_new_tokens: int = 16
    micro_batch: int = 4
    seed: int = 0
    in_flight: int | None = None  # micro-batches in flight per replica; default scheduling.in_flight_limit
    rate: float | None = None  # requests/s (Poisson); None: offline, all requests at once
    warmup: bool = True
    prefill_chunk: int = 0  # prompt tokens per prefill step; 0: the whole prompt in one step

    def validate(self, cfg: ModelConfig) -> None:
        for name in ("requests", "prompt_len", "max_new_tokens", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_chunk < 0:
            raise ValueError(f"--prefill-chunk must be >= 0 tokens (0: whole prompt), got {self.prefill_chunk}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"--rate must be > 0 requests/s, got {self.rate}")
        if self.prompt_len + self.max_new_tokens - 1 > cfg.max_seq:
            raise ValueError(
                f"prompt_len + max_new_tokens - 1 = {self.prompt_len + self.max_new_tokens - 1} "
                f"exceeds max_seq={cfg.max_seq}"
            )


@dataclass
class StageReport:
    replica: int
    index: int
    node_ip: str
    node_id: str
    units: list[int]
    layers: int
    has_embedding: bool
    has_head: bool
    busy_s: float  # wall time inside forward: compute, plus any CPU-quota throttling during it
    cpu_s: float  # CPU time of the stage's process inside forward (all its threads)
    cpu_quota: float | None  # the container's CFS quota in CPUs, None when unlimited
    capacity_s: float  # busy time against the quota: max(busy_s, cpu_s / cpu_quota), see metrics.capacity_time
    idle_s: float
    calls: int
    num_threads: int
    device: str
    process_cpu_s: float = 0.0  # CPU time of the stage's whole process over the run: forward, Ray's work, its threads
    container_cpu_s: float | None = None  # CPU time of every process in the stage's container over the run
    others_cpus: float = 0.0  # CPU rate of the container's other processes (driver, GCS...): shares the quota
    span_s: float = 0.0  # from the start of its first forward to the end of its last (its own clock)


@dataclass
class ReplicaReport:
    index: int
    node_ips: list[str]
    micro_batches: int
    requests: int
    tokens: int
    busiest_s: float
    imbalance: float


@dataclass
class RunResult:
    requests: int
    completed: int
    generated_tokens: int
    wall_s: float
    in_flight: int
    driver_cpu_s: float = 0.0  # CPU time of the driver process over the run (it submits and relays every step)
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)  # per request, in request order
    groups: list[list[int]] = field(default_factory=list)  # request ids of each micro-batch, in dispatch order
    stages: list[StageReport] = field(default_factory=list)
    replicas: list[ReplicaReport] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.completed / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """Throughput, latency and balance of this run as JSON-ready numbers."""
        busy = [s.busy_s for s in self.stages]
        capacity = [s.capacity_s for s in self.stages]
        return {
            "tokens_per_s": self.tokens_per_s,
            "requests_per_s": self.requests_per_s,
            "requests": self.requests,
            "completed": self.completed,
            "generated_tokens": self.generated_tokens,
            "wall_s": self.wall_s,
            "in_flight": self.in_flight,
            "driver_cpu_s": self.driver_cpu_s,
            "imbalance": metrics.imbalance(busy),
            "imbalance_capacity": metrics.imbalance(capacity),
            "t_max_minus_t_min_s": metrics.spread(busy),
            "utilisation": metrics.utilisation(busy),
            "latency_s": {
                "ttft": metrics.latency_summary(self.ttft_s),
                "tpot": metrics.latency_summary(self.tpot_s),
                "e2e": metrics.latency_summary(self.e2e_s),
            },
        }

    def stage_dicts(self) -> list[dict[str, Any]]:
        return [asdict(s) for s in self.stages]

    def replica_dicts(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.replicas]


def make_prompts(vocab: int, requests: int, prompt_len: int, seed: int) -> torch.Tensor:
    """The benchmark's random prompts, int64 [requests, prompt_len], reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, vocab, size=(requests, prompt_len), dtype=np.int64))


def setup_replicas(replicas: list[list[Any]], ranges: list[list[tuple[int, int]]]) -> list[dict[str, Any]]:
    """Build each replica's stages (units per stage from ``ranges``); returns what each setup reported."""
    if len(ranges) != len(replicas):
        raise ValueError(f"{len(ranges)} partitions for {len(replicas)} replicas")
    calls: list[Any] = []
    for workers, stage_ranges in zip(replicas, ranges, strict=True):
        if len(stage_ranges) != len(workers):
            raise ValueError(f"{len(stage_ranges)} stage ranges for {len(workers)} workers")
        calls.extend(w.setup.remote(a, b) for w, (a, b) in zip(workers, stage_ranges, strict=True))
    return list(ray.get(calls))


def _submit_step(workers: list[Any], cache_id: int, x: Any, position: int) -> Any:
    ref = x
    for w in workers:
        ref = w.forward.remote(cache_id, ref, position)
    return ref


def _warm_up(workers: list[Any], prompts: torch.Tensor, decode_steps: int, prefill_chunk: int) -> None:
    """Prefill + a few decode steps of one micro-batch so lazy init and allocators are out of the way."""
    for a, b in prefill_chunks(prompts.shape[1], prefill_chunk):
        tokens = ray.get(_submit_step(workers, WARMUP_CACHE_ID, prompts[:, a:b], a))
    position = prompts.shape[1]
    for _ in range(decode_steps):
        tokens = ray.get(_submit_step(workers, WARMUP_CACHE_ID, tokens[:, None], position))
        position += 1
    ray.get([w.release.remote(WARMUP_CACHE_ID) for w in workers])


@dataclass
class _Batch:
    replica: int
    rows: list[int]
    chunks: list[tuple[int, int]]  # prompt pieces still to feed; the first is in flight
    position: int = 0  # tokens in the stages' KV caches once the step in flight is done


def run_workload(
    replicas: list[list[Any]], ranges: list[list[tuple[int, int]]], cfg: ModelConfig, params: BenchParams
) -> RunResult:
    """Stream ``params.requests`` greedy generations through the (already set up) replicas."""
    params.validate(cfg)
    flat = [w for workers in replicas for w in workers]
    infos = ray.get([w.node_info.remote() for w in flat])
    prompts = make_prompts(cfg.vocab, params.requests, params.prompt_len, params.seed)
    if params.warmup:
        warm = prompts[: params.micro_batch]
        for workers in replicas:
            _warm_up(workers, warm, min(2, params.max_new_tokens - 1), params.prefill_chunk)
    ray.get([w.reset_stats.remote() for w in flat])

    stages = len(replicas[0])
    pieces = prefill_chunks(params.prompt_len, params.prefill_chunk)
    limit = in_flight_limit(stages, params.requests, params.micro_batch, params.rate, params.in_flight)
    arrivals = arrival_times(params.requests, params.rate, params.seed)
    rng = random.Random(params.seed)
    tokens: list[list[int]] = [[] for _ in range(params.requests)]
    first_at = [0.0] * params.requests
    done_at = [0.0] * params.requests
    waiting: deque[int] = deque()
    in_flight = [0] * len(replicas)  # micro-batches
    load = [0] * len(replicas)  # outstanding requests: what the router balances
    served = [[0, 0, 0] for _ in replicas]  # micro-batches, requests, tokens
    batches: dict[int, _Batch] = {}
    pending: dict[Any, int] = {}
    groups: list[list[int]] = []
    releases: list[Any] = []
    arrived = 0
    completed = 0
    began, cpu_began = time.perf_counter(), time.process_time()

    def feed_prompt(batch_id: int, batch: _Batch) -> None:
        """Send the next piece of the batch's prompt through its replica."""
        a, b = batch.chunks[0]
        batch.position = b
        pending[_submit_step(replicas[batch.replica], batch_id, prompts[batch.rows, a:b], a)] = batch_id

    def dispatch() -> None:
        while waiting:
            free = [r for r in range(len(replicas)) if in_flight[r] < limit]
            if not free:
                return
            r = power_of_two_choice(free, load, rng)
            rows = [waiting.popleft() for _ in range(min(params.micro_batch, len(waiting)))]
            batch_id = len(groups)
            groups.append(rows)
            batch = batches[batch_id] = _Batch(r, rows, list(pieces))
            in_flight[r] += 1
            load[r] += len(rows)
            served[r][0] += 1
            served[r][1] += len(rows)
            feed_prompt(batch_id, batch)

    while completed < params.requests:
        now = time.perf_counter() - began
        while arrived < params.requests and arrivals[arrived] <= now:
            waiting.append(arrived)
            arrived += 1
        dispatch()
        next_arrival = arrivals[arrived] - now if arrived < params.requests else None
        if not pending:
            time.sleep(max(0.0, next_arrival or 0.0))
            continue
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=next_arrival)
        for ref in ready:
            batch_id = pending.pop(ref)
            batch = batches[batch_id]
            step_tokens: torch.Tensor = ray.get(ref)
            now = time.perf_counter() - began
            if batch.chunks:
                batch.chunks.pop(0)
                if batch.chunks:  # more of the prompt to feed; this piece's token is not an output
                    feed_prompt(batch_id, batch)
                    continue
            for row, tok in zip(batch.rows, step_tokens.tolist(), strict=True):
                tokens[row].append(int(tok))
                if len(tokens[row]) == 1:
                    first_at[row] = now
            served[batch.replica][2] += len(batch.rows)
            if len(tokens[batch.rows[0]]) < params.max_new_tokens:
                step = _submit_step(replicas[batch.replica], batch_id, step_tokens[:, None], batch.position)
                batch.position += 1
                pending[step] = batch_id
                continue
            for row in batch.rows:
                done_at[row] = now
            completed += len(batch.rows)
            in_flight[batch.replica] -= 1
            load[batch.replica] -= len(batch.rows)
            releases.extend(w.release.remote(batch_id) for w in replicas[batch.replica])
            del batches[batch_id]
    wall_s = time.perf_counter() - began
    driver_cpu_s = time.process_time() - cpu_began
    ray.get(releases)
    stats = ray.get([w.stats.remote() for w in flat])

    stages_on_node: dict[str, int] = {}
    for info in infos:  # a container shared by several stages cannot tell their shares apart
        stages_on_node[str(info["node_id"])] = stages_on_node.get(str(info["node_id"]), 0) + 1
    stage_reports: list[StageReport] = []
    for i, (info, stat) in enumerate(zip(infos, stats, strict=True)):
        r, s = divmod(i, stages)
        start, end = ranges[r][s]
        stage_busy = float(stat["busy_s"])
        stage_cpu = float(stat.get("cpu_s", 0.0))
        quota = info.get("cpu_quota")
        process_cpu = float(stat.get("process_cpu_s", 0.0))
        container_cpu = stat.get("container_cpu_s")
        window = float(stat.get("stats_wall_s") or 0.0)
        others = 0.0
        if container_cpu is not None and window > 0 and stages_on_node[str(info["node_id"])] == 1:
            others = max(0.0, float(container_cpu) - process_cpu) / window
        stage_reports.append(
            StageReport(
                replica=r,
                index=s,
                node_ip=str(info["node_ip"]),
                node_id=str(info["node_id"]),
                units=[start, end],
                layers=blocks_held(start, end, cfg.layers),
                has_embedding=start == 0,
                has_head=end == cfg.num_units,
                busy_s=stage_busy,
                cpu_s=stage_cpu,
                cpu_quota=float(quota) if quota else None,
                capacity_s=metrics.capacity_time(stage_busy, stage_cpu, float(quota) if quota else None, others),
                idle_s=max(0.0, wall_s - stage_busy),
                calls=int(stat["calls"]),
                num_threads=int(info["num_threads"]),
                device=str(info.get("device", "cpu")),
                process_cpu_s=process_cpu,
                container_cpu_s=float(container_cpu) if container_cpu is not None else None,
                others_cpus=others,
                span_s=float(stat.get("span_s", 0.0)),
            )
        )
    replica_reports = []
    for r in range(len(replicas)):
        busy = [s.busy_s for s in stage_reports if s.replica == r]
        replica_reports.append(
            ReplicaReport(
                index=r,
                node_ips=[s.node_ip for s in stage_reports if s.replica == r],
                micro_batches=served[r][0],
                requests=served[r][1],
                tokens=served[r][2],
                busiest_s=max(busy),
                imbalance=metrics.imbalance(busy),
            )
        )
    ttft = [first_at[i] - arrivals[i] for i in range(params.requests)]
    e2e = [done_at[i] - arrivals[i] for i in range(params.requests)]
    tpot = (
        [(e2e[i] - ttft[i]) / (params.max_new_tokens - 1) for i in range(params.requests)]
        if params.max_new_tokens > 1
        else []
    )
    return RunResult(
        requests=params.requests,
        completed=completed,
        generated_tokens=sum(len(t) for t in tokens),
        wall_s=wall_s,
        in_flight=limit,
        driver_cpu_s=driver_cpu_s,
        ttft_s=ttft,
        tpot_s=tpot,
        e2e_s=e2e,
        tokens=tokens,
        groups=groups,
        stages=stage_reports,
        replicas=replica_reports,
    )


def check_output(cfg: ModelConfig, params: BenchParams, result: RunResult, num_requests: int = 8) -> dict[str, Any]:
    """Compare the pipeline's greedy tokens with the unsharded model's, micro-batch by micro-batch.

    The reference runs the same micro-batches (same requests grouped the same way) so both sides
    do identically shaped matmuls; at least ``num_requests`` requests are compared.
    """
    prompts = make_prompts(cfg.vocab, params.requests, params.prompt_len, params.seed)
    model = full_model_stage(cfg, emit="tokens")
    compared = 0
    mismatched: list[int] = []
    for rows in result.groups:
        if compared >= max(1, num_requests):
            break
        generated = greedy_generate([model], prompts[rows], params.max_new_tokens, prefill_chunk=params.prefill_chunk)
        expected = generated.tolist()
        mismatched.extend(row for row, exp in zip(rows, expected, strict=True) if result.tokens[row] != exp)
        compared += len(rows)
    return {"identical": not mismatched and compared > 0, "compared_requests": compared, "mismatched": mismatched}
