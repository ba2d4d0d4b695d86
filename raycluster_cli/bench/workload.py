"""The driver's event loop: requests arrive, form micro-batches, are routed to a pipeline replica
and streamed through its stages until every request has its tokens.

Each replica keeps at least ``stages + 1`` micro-batches in flight so no stage waits for work it
could have; prefill and every decode step go through all stages.  A micro-batch is formed as soon
as a replica has room: up to ``micro_batch`` requests that have arrived (offline mode: all of them
arrived at 0, so batches are full; ``rate`` mode: Poisson arrivals, batches take what is waiting).
The replica is chosen by power of two choices on outstanding requests.  Latencies are measured from
each request's arrival.

A node lost in the middle of a run (its actor dies, or a step gets no answer for
``step_timeout_s``) takes its replica out: the replica's requests in flight start again from their
prompt on the other replicas and the result counts them and names the stage.  With no replica left
the run stops with ``StageLost``, which says how many requests had completed.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil
import ray
import torch

from raycluster_cli.bench.planning import arrival_times, in_flight_limit, power_of_two_choice
from raycluster_cli.bench.results import (
    BenchParams,
    LostStage,
    RunResult,
    StageReport,
    replica_report,
    stage_report,
    window_rates,
)
from raycluster_cli.models.decoder import ModelConfig, prefill_chunks
from raycluster_cli.node import stage_worker as pipeline

__all__ = ["BenchParams", "RunResult", "StageLost", "make_prompts", "run_workload", "setup_replicas"]

WARMUP_CACHE_ID = -1
PROBE_TIMEOUT_S = 10.0
PROGRESS_EVERY_S = 0.5

Report = Callable[..., None]


class StageLost(RuntimeError):
    """Every replica lost a stage: the run cannot finish.  ``failure`` says where and how far it got."""

    def __init__(self, lost: LostStage, completed: int, requests: int) -> None:
        self.failure = {
            "replica": lost.replica,
            "stage": lost.stage,
            "node_ip": lost.node_ip,
            "error": lost.error,
            "at_s": round(lost.at_s, 3),
            "completed": completed,
            "failed": requests - completed,
            "requests": requests,
        }
        super().__init__(
            f"stage {lost.stage} on {lost.node_ip} was lost after {completed} of {requests} request(s) "
            f"completed ({requests - completed} not completed): {lost.error}"
        )


def _quiet(*_: Any, **__: Any) -> None:
    pass


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
    setups = list(ray.get(calls))
    for workers in replicas:
        pipeline.link_stages(workers)
    return setups


def _submit_step(workers: list[Any], cache_id: int, x: Any, position: int, hops: str) -> Any:
    """One step of a micro-batch through every stage; the ObjectRef of its tokens, or of the next
    reference in the chain (direct hops: each stage calls the next and returns that call's reference)."""
    if hops == "direct":
        return workers[0].forward.remote(cache_id, x, position, True)
    ref = x
    for w in workers:
        ref = w.forward.remote(cache_id, ref, position)
    return ref


def _warm_up(workers: list[Any], prompts: torch.Tensor, decode_steps: int, prefill_chunk: int, hops: str) -> None:
    """Prefill + a few decode steps of one micro-batch so lazy init and allocators are out of the way."""
    for a, b in prefill_chunks(prompts.shape[1], prefill_chunk):
        tokens = pipeline.resolve(_submit_step(workers, WARMUP_CACHE_ID, prompts[:, a:b], a, hops))
    position = prompts.shape[1]
    for _ in range(decode_steps):
        tokens = pipeline.resolve(_submit_step(workers, WARMUP_CACHE_ID, tokens[:, None], position, hops))
        position += 1
    ray.get([w.release.remote(WARMUP_CACHE_ID) for w in workers])


@dataclass
class _Batch:
    replica: int
    rows: list[int]
    chunks: list[tuple[int, int]]  # prompt pieces still to feed; the first is in flight
    position: int = 0  # tokens in the stages' KV caches once the step in flight is done


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]


def _stage_of(workers: list[Any], exc: BaseException | None) -> int:
    """Which stage of a replica failed: the actor named by the error, else the first that does not answer."""
    actor_id = getattr(exc, "actor_id", None)
    if actor_id:
        for index, worker in enumerate(workers):
            if worker._actor_id.hex() == actor_id:
                return index
    pings = [w.node_info.remote() for w in workers]
    _, silent = ray.wait(pings, num_returns=len(pings), timeout=PROBE_TIMEOUT_S)
    for index, ping in enumerate(pings):
        if ping in silent:
            return index
        try:
            ray.get(ping)
        except ray.exceptions.RayError:
            return index
    return -1


class _Workload:
    """One run's state: what is waiting, what is in flight on which replica, what each request got."""

    def __init__(
        self,
        replicas: list[list[Any]],
        infos: list[dict[str, Any]],
        cfg: ModelConfig,
        params: BenchParams,
        report: Report,
    ) -> None:
        self.replicas, self.infos, self.cfg, self.params, self.report = replicas, infos, cfg, params, report
        n = params.requests
        self.prompts = make_prompts(cfg.vocab, n, params.prompt_len, params.seed)
        self.pieces = prefill_chunks(params.prompt_len, params.prefill_chunk)
        self.limit = in_flight_limit(
            len(replicas[0]), n, params.micro_batch, params.rate, params.in_flight, len(replicas)
        )
        self.arrivals = arrival_times(n, params.rate, params.seed)
        self.rng = random.Random(params.seed)
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.first_at = [0.0] * n
        self.done_at = [0.0] * n
        self.waiting: deque[int] = deque()
        self.alive = [True] * len(replicas)
        self.in_flight = [0] * len(replicas)  # micro-batches
        self.load = [0] * len(replicas)  # outstanding requests: what the router balances
        self.served = [[0, 0, 0] for _ in replicas]  # micro-batches, requests, tokens
        self.batches: dict[int, _Batch] = {}
        self.pending: dict[Any, tuple[int, float]] = {}  # step ref -> (batch id, submitted at)
        self.groups: list[list[int]] = []
        self.releases: list[tuple[int, Any]] = []  # (replica, ref)
        self.events: list[tuple[float, int]] = []  # (seconds into the run, tokens produced)
        self.lost: list[LostStage] = []
        self.retried: set[int] = set()
        self.arrived = self.completed = 0
        self.began = time.perf_counter()
        self.reported_at = 0.0

    def now(self) -> float:
        return time.perf_counter() - self.began

    def submit(self, batch_id: int, x: Any, position: int) -> None:
        batch = self.batches[batch_id]
        step = _submit_step(self.replicas[batch.replica], batch_id, x, position, self.params.hops)
        self.pending[step] = (batch_id, self.now())

    def feed_prompt(self, batch_id: int) -> None:
        """Send the next piece of the batch's prompt through its replica."""
        batch = self.batches[batch_id]
        a, b = batch.chunks[0]
        batch.position = b
        self.submit(batch_id, self.prompts[batch.rows, a:b], a)

    def dispatch(self) -> None:
        while self.waiting:
            free = [r for r in range(len(self.replicas)) if self.alive[r] and self.in_flight[r] < self.limit]
            if not free:
                return
            r = power_of_two_choice(free, self.load, self.rng)
            rows = [self.waiting.popleft() for _ in range(min(self.params.micro_batch, len(self.waiting)))]
            batch_id = len(self.groups)
            self.groups.append(rows)
            self.batches[batch_id] = _Batch(r, rows, list(self.pieces))
            self.in_flight[r] += 1
            self.load[r] += len(rows)
            self.served[r][0] += 1
            self.served[r][1] += len(rows)
            self.feed_prompt(batch_id)

    def on_step(self, batch_id: int, step_tokens: torch.Tensor) -> None:
        batch = self.batches[batch_id]
        now = self.now()
        if batch.chunks:
            batch.chunks.pop(0)
            if batch.chunks:  # more of the prompt to feed; this piece's token is not an output
                self.feed_prompt(batch_id)
                return
        for row, tok in zip(batch.rows, step_tokens.tolist(), strict=True):
            self.tokens[row].append(int(tok))
            if len(self.tokens[row]) == 1:
                self.first_at[row] = now
        self.served[batch.replica][2] += len(batch.rows)
        self.events.append((now, len(batch.rows)))
        if len(self.tokens[batch.rows[0]]) < self.params.max_new_tokens:
            self.submit(batch_id, step_tokens[:, None], batch.position)
            batch.position += 1
            return
        for row in batch.rows:
            self.done_at[row] = now
        self.completed += len(batch.rows)
        self.in_flight[batch.replica] -= 1
        self.load[batch.replica] -= len(batch.rows)
        self.releases.extend((batch.replica, w.release.remote(batch_id)) for w in self.replicas[batch.replica])
        del self.batches[batch_id]

    def lose_replica(self, replica: int, exc: BaseException | None, why: str, final: bool = True) -> None:
        """Take a replica out; its requests in flight wait again, at the front, for another replica.

        ``final``: losing the last replica ends the run (``StageLost``); not so once every request completed.
        """
        stage = _stage_of(self.replicas[replica], exc)
        info = self.infos[replica * len(self.replicas[0]) + max(stage, 0)]
        self.alive[replica] = False
        lost_batches = sorted(b for b, batch in self.batches.items() if batch.replica == replica)
        self.pending = {ref: v for ref, v in self.pending.items() if self.batches[v[0]].replica != replica}
        rows = [row for b in lost_batches for row in self.batches.pop(b).rows]
        for row in rows:
            self.tokens[row] = []
        self.waiting.extendleft(reversed(rows))
        self.retried.update(rows)
        self.in_flight[replica] = self.load[replica] = 0
        node_ip = str(info["node_ip"]) if stage >= 0 else "?"
        lost = LostStage(
            replica, stage, node_ip, str(info["node_id"]) if stage >= 0 else "", why, self.now(), len(rows)
        )
        self.lost.append(lost)
        self.report("node lost", node_ip=node_ip, stage=stage, replica=replica, retried=len(rows), error=why)
        if final and not any(self.alive):
            raise StageLost(lost, self.completed, self.params.requests)

    def check_stalled(self) -> None:
        """A step that got no answer for ``step_timeout_s``: its replica's node froze or vanished."""
        now = self.now()
        for batch_id, submitted in list(self.pending.values()):
            if now - submitted > self.params.step_timeout_s and batch_id in self.batches:
                replica = self.batches[batch_id].replica
                self.lose_replica(replica, None, f"no answer for {self.params.step_timeout_s:.0f}s")
                return

    def wait_once(self) -> None:
        n = self.params.requests
        next_arrival = self.arrivals[self.arrived] - self.now() if self.arrived < n else None
        if not self.pending:
            time.sleep(max(0.0, next_arrival or 0.0))
            return
        timeout = self.params.step_timeout_s if next_arrival is None else min(next_arrival, self.params.step_timeout_s)
        timeout = max(0.0, timeout)  # an arrival already due: poll (ray.wait refuses a negative timeout)
        ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=timeout)
        if not ready:
            self.check_stalled()
        for ref in ready:
            if ref not in self.pending:  # its replica was lost meanwhile
                continue
            batch_id, submitted = self.pending.pop(ref)
            try:
                step_tokens = ray.get(ref)
            except ray.exceptions.RayError as exc:
                self.lose_replica(self.batches[batch_id].replica, exc, _one_line(exc))
                continue
            if isinstance(step_tokens, ray.ObjectRef):  # direct hops: a stage passed the step on
                self.pending[step_tokens] = (batch_id, submitted)
                continue
            self.on_step(batch_id, step_tokens)

    def run(self) -> float:
        """Until every request has its tokens; returns the wall time."""
        n = self.params.requests
        self.report("requests", 0, n)
        while self.completed < n:
            while self.arrived < n and self.arrivals[self.arrived] <= self.now():
                self.waiting.append(self.arrived)
                self.arrived += 1
            self.dispatch()
            self.wait_once()
            if self.now() - self.reported_at >= PROGRESS_EVERY_S:
                self.reported_at = self.now()
                self.report("requests", self.completed, n)
        self.report("requests", n, n)
        return self.now()

    def stage_reports(
        self, stats: dict[int, dict[str, Any]], ranges: list[list[tuple[int, int]]], wall_s: float
    ) -> list[StageReport]:
        per_node: dict[str, int] = {}
        for info in self.infos:  # a container shared by several stages cannot tell their shares apart
            per_node[str(info["node_id"])] = per_node.get(str(info["node_id"]), 0) + 1
        stages = len(self.replicas[0])
        reports = []
        for i, stat in sorted(stats.items()):
            r, s = divmod(i, stages)
            info = self.infos[i]
            shared = per_node[str(info["node_id"])] > 1
            reports.append(stage_report((r, s), ranges[r][s], info, stat, self.cfg, wall_s, shared))
        return reports


def run_workload(
    replicas: list[list[Any]],
    ranges: list[list[tuple[int, int]]],
    cfg: ModelConfig,
    params: BenchParams,
    report: Report = _quiet,
) -> RunResult:
    """Stream ``params.requests`` greedy generations through the (already set up) replicas."""
    params.validate(cfg)
    flat = [w for workers in replicas for w in workers]
    infos = ray.get([w.node_info.remote() for w in flat])
    if params.warmup:
        warm = make_prompts(cfg.vocab, params.micro_batch, params.prompt_len, params.seed)
        for workers in replicas:
            _warm_up(workers, warm, min(2, params.max_new_tokens - 1), params.prefill_chunk, params.hops)
    ray.get([w.reset_stats.remote() for w in flat])
    work = _Workload(replicas, infos, cfg, params, report)
    cpu = psutil.Process()
    cpu_began = sum(cpu.cpu_times()[:2])
    wall_s = work.run()
    driver_cpu_s = sum(cpu.cpu_times()[:2]) - cpu_began
    stats = _alive_stats(work)
    stages = work.stage_reports(stats, ranges, wall_s)
    n = params.requests
    ttft = [work.first_at[i] - work.arrivals[i] for i in range(n)]
    e2e = [work.done_at[i] - work.arrivals[i] for i in range(n)]
    tpot = [(e2e[i] - ttft[i]) / (params.max_new_tokens - 1) for i in range(n)] if params.max_new_tokens > 1 else []
    return RunResult(
        requests=n,
        completed=work.completed,
        generated_tokens=sum(len(t) for t in work.tokens),
        wall_s=wall_s,
        in_flight=work.limit,
        driver_cpu_s=driver_cpu_s,
        ttft_s=ttft,
        tpot_s=tpot,
        e2e_s=e2e,
        tokens=work.tokens,
        groups=work.groups,
        stages=stages,
        replicas=[replica_report(r, stages, work.served[r], not work.alive[r]) for r in range(len(replicas))],
        window_tokens_per_s=window_rates(work.events, wall_s),
        lost=work.lost,
        retried_requests=len(work.retried),
    )


def _alive_stats(work: _Workload) -> dict[int, dict[str, Any]]:
    """Each stage's stats, by flat index, from the replicas still alive (after their caches are freed).

    A replica whose node dies after the last request completed loses only its stats: it is recorded
    as lost (nothing to retry) and the run's result stands on the others.
    """
    stages = len(work.replicas[0])
    stats: dict[int, dict[str, Any]] = {}
    # Every replica asked at once; each answer read on its own, so one dead node costs only its replica.
    asked = {r: [w.stats.remote() for w in workers] for r, workers in enumerate(work.replicas) if work.alive[r]}
    for replica, stat_refs in asked.items():
        try:
            ray.get([ref for r, ref in work.releases if r == replica], timeout=work.params.step_timeout_s)
            got = ray.get(stat_refs, timeout=work.params.step_timeout_s)
        except ray.exceptions.RayError as exc:
            work.lose_replica(replica, exc, _one_line(exc), final=False)
            continue
        stats.update({replica * stages + s: stat for s, stat in enumerate(got)})
    return stats
