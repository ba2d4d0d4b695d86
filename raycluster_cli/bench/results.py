"""What one workload run measured: per stage, per replica, per request; and the parameters it ran with.

Pure Python apart from nothing: no torch, no Ray, so the reports are unit-tested with plain numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from raycluster_cli.bench.options import HOPS
from raycluster_cli.models.config import ModelConfig
from raycluster_cli.placement import balance
from raycluster_cli.placement.partition import blocks_held

# Throughput is also measured in this many equal windows of the run; the first and the last hold
# the pipeline filling and draining, the ones between are the steady state whose spread is reported.
WINDOWS = 5


@dataclass
class BenchParams:
    requests: int = 32
    prompt_len: int = 32
    max_new_tokens: int = 16
    micro_batch: int = 4
    seed: int = 0
    in_flight: int | None = None  # micro-batches in flight per replica; default planning.in_flight_limit
    rate: float | None = None  # requests/s (Poisson); None: offline, all requests at once
    warmup: bool = True
    prefill_chunk: int = 0  # prompt tokens per prefill step; 0: the whole prompt in one step
    step_timeout_s: float = 30.0  # a step with no answer for this long: its replica is lost
    hops: str = "driver"  # "driver": the driver chains the calls; "direct": stage i calls stage i+1 itself

    def validate(self, cfg: ModelConfig) -> None:
        for name in ("requests", "prompt_len", "max_new_tokens", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hops not in HOPS:
            raise ValueError(f"hops must be one of {', '.join(HOPS)}, got {self.hops!r}")
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
    capacity_s: float  # busy time against the quota: max(busy_s, process_cpu_s / its share), balance.capacity_time
    idle_s: float
    calls: int
    num_threads: int
    device: str
    process_cpu_s: float = 0.0  # CPU time of the stage's whole process over the run: forward, Ray's work, its threads
    container_cpu_s: float | None = None  # CPU time of every process in the stage's container over the run
    others_cpus: float = 0.0  # CPU rate of the container's other processes (driver, GCS...): shares the quota
    span_s: float = 0.0  # from the start of its first forward to the end of its last (its own clock)
    # Where idle_s falls (balance.idle_breakdown): before the first call, between calls, after the last.
    idle_fill_s: float | None = None
    idle_between_s: float | None = None
    idle_drain_s: float | None = None
    idle_between_windows_s: list[float] = field(default_factory=list)  # between-call idle per fifth of the run
    longest_gap_s: float | None = None
    quota_used: float | None = None  # container CPU / (quota x wall): 1.0 = the quota bound the whole run
    weights_bytes: int | None = None  # the stage's parameters and buffers at the run's dtype
    cache_peak_bytes: int | None = None  # the most KV cache it held at once
    working_set_bytes: int | None = None  # its container's memory in use after the run (page cache left out)
    memory_peak_bytes: int | None = None  # its container's peak memory use (cgroup; page cache included)
    process_peak_rss_bytes: int | None = None  # the stage worker process's own peak resident memory


@dataclass
class ReplicaReport:
    index: int
    node_ips: list[str]
    micro_batches: int
    requests: int
    tokens: int
    busiest_s: float
    imbalance: float
    lost: bool = False


@dataclass
class LostStage:
    """A stage whose node stopped answering during a run, and what that cost."""

    replica: int
    stage: int
    node_ip: str
    node_id: str
    error: str
    at_s: float  # seconds into the run
    requests_retried: int  # requests in flight on its replica, started again on another one


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
    window_tokens_per_s: list[float] = field(default_factory=list)
    lost: list[LostStage] = field(default_factory=list)
    retried_requests: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.completed / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """Throughput, latency and balance of this run as JSON-ready numbers."""
        busy = [s.busy_s for s in self.stages] or [0.0]
        capacity = [s.capacity_s for s in self.stages] or [0.0]
        return {
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_spread": balance.relative_spread(self.window_tokens_per_s[1:-1]),
            "window_tokens_per_s": self.window_tokens_per_s,
            "requests_per_s": self.requests_per_s,
            "requests": self.requests,
            "completed": self.completed,
            "failed": self.requests - self.completed,
            "retried_requests": self.retried_requests,
            "generated_tokens": self.generated_tokens,
            "wall_s": self.wall_s,
            "in_flight": self.in_flight,
            "driver_cpu_s": self.driver_cpu_s,
            "imbalance": balance.imbalance(busy),
            "imbalance_capacity": balance.imbalance(capacity),
            "t_max_minus_t_min_s": balance.spread(busy),
            "utilisation": balance.utilisation(busy),
            "latency_s": {
                "ttft": balance.latency_summary(self.ttft_s),
                "tpot": balance.latency_summary(self.tpot_s),
                "e2e": balance.latency_summary(self.e2e_s),
            },
        }

    def stage_dicts(self) -> list[dict[str, Any]]:
        return [asdict(s) for s in self.stages]

    def replica_dicts(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.replicas]

    def lost_dicts(self) -> list[dict[str, Any]]:
        return [asdict(x) for x in self.lost]


def window_rates(events: list[tuple[float, int]], wall_s: float, windows: int = WINDOWS) -> list[float]:
    """Tokens per second in ``windows`` equal slices of [0, wall_s]; ``events`` are (time, tokens)."""
    if wall_s <= 0 or windows < 1:
        return []
    width = wall_s / windows
    counts = [0] * windows
    for at, tokens in events:
        counts[min(windows - 1, max(0, int(at / width)))] += tokens
    return [c / width for c in counts]


def stage_report(
    position: tuple[int, int],
    units: tuple[int, int],
    info: dict[str, Any],
    stat: dict[str, Any],
    cfg: ModelConfig,
    wall_s: float,
    shares_node: bool,
) -> StageReport:
    """One stage's figures from its worker's ``node_info`` and ``stats`` (``shares_node``: another stage
    runs in the same container, so the container's CPU cannot be split between them)."""
    start, end = units
    busy = float(stat["busy_s"])
    cpu = float(stat.get("cpu_s", 0.0))
    quota = float(info["cpu_quota"]) if info.get("cpu_quota") else None
    process_cpu = float(stat.get("process_cpu_s", 0.0))
    container_cpu = stat.get("container_cpu_s")
    window = float(stat.get("stats_wall_s") or 0.0)
    others = 0.0
    if container_cpu is not None and window > 0 and not shares_node:
        others = max(0.0, float(container_cpu) - process_cpu) / window
    idle: dict[str, Any] = {}
    if "intervals" in stat:  # a node image older than the CLI does not send them
        idle = balance.idle_breakdown(stat["intervals"], wall_s, WINDOWS)
    return StageReport(
        replica=position[0],
        index=position[1],
        node_ip=str(info["node_ip"]),
        node_id=str(info["node_id"]),
        units=[start, end],
        layers=blocks_held(start, end, cfg.layers),
        has_embedding=start == 0,
        has_head=end == cfg.num_units,
        busy_s=busy,
        cpu_s=cpu,
        cpu_quota=quota,
        capacity_s=balance.capacity_time(busy, process_cpu or cpu, quota, others),
        idle_s=max(0.0, wall_s - busy),
        calls=int(stat["calls"]),
        num_threads=int(info["num_threads"]),
        device=str(info.get("device", "cpu")),
        process_cpu_s=process_cpu,
        container_cpu_s=float(container_cpu) if container_cpu is not None else None,
        others_cpus=others,
        span_s=float(stat.get("span_s", 0.0)),
        idle_fill_s=idle.get("idle_fill_s"),
        idle_between_s=idle.get("idle_between_s"),
        idle_drain_s=idle.get("idle_drain_s"),
        idle_between_windows_s=list(idle.get("idle_between_windows_s", [])),
        longest_gap_s=idle.get("longest_gap_s"),
        quota_used=None if shares_node else balance.quota_used(container_cpu, quota, window),
        weights_bytes=stat.get("weights_bytes"),
        cache_peak_bytes=stat.get("cache_peak_bytes"),
        working_set_bytes=(stat.get("memory") or {}).get("working_set_bytes"),
        memory_peak_bytes=(stat.get("memory") or {}).get("peak_bytes"),
        process_peak_rss_bytes=stat.get("process_peak_rss_bytes"),
    )


def replica_report(index: int, stages: list[StageReport], served: list[int], lost: bool) -> ReplicaReport:
    """A replica's load (``served``: micro-batches, requests, tokens) and balance."""
    busy = [s.busy_s for s in stages if s.replica == index] or [0.0]
    return ReplicaReport(
        index=index,
        node_ips=[s.node_ip for s in stages if s.replica == index],
        micro_batches=served[0],
        requests=served[1],
        tokens=served[2],
        busiest_s=max(busy),
        imbalance=balance.imbalance(busy),
        lost=lost,
    )
