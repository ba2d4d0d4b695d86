"""The benchmark's plan in plain numbers: arrivals, routing, which nodes make a replica, micro-batch sizes and
the ceilings a run is read against.

No torch, no Ray: everything here is unit-tested with plain numbers.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any


def arrival_times(requests: int, rate: float | None, seed: int) -> list[float]:
    """Seconds after the start at which each request arrives.

    ``rate`` None (offline mode): every request is there at 0.  Otherwise a Poisson process of
    ``rate`` requests/s: exponential gaps with mean 1/rate, the first request at its first gap.
    """
    if requests < 0:
        raise ValueError(f"requests must be >= 0, got {requests}")
    if rate is None:
        return [0.0] * requests
    if rate <= 0:
        raise ValueError(f"--rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed)
    now = 0.0
    out = []
    for _ in range(requests):
        now += rng.expovariate(rate)
        out.append(now)
    return out


def power_of_two_choice(candidates: Sequence[int], loads: Sequence[float], rng: random.Random) -> int:
    """Pick two distinct candidates at random and return the less loaded (the first on a tie).

    With one candidate that one; "power of two choices" keeps the maximum load close to the mean
    without looking at every replica's queue.
    """
    if not candidates:
        raise ValueError("no replica to route to")
    if len(candidates) == 1:
        return candidates[0]
    first, second = rng.sample(list(candidates), 2)
    return first if loads[first] <= loads[second] else second


def replica_nodes(num_nodes: int, stages: int, replicas: int | None, allow_shared: bool) -> list[list[int]]:
    """Node indices of each replica's stages: replica r, stage s on node r*stages + s.

    By default as many replicas as fit with one stage per node (``num_nodes // stages``); asking for
    more needs ``allow_shared`` (stages then wrap around the nodes, for single-machine tests).
    """
    if num_nodes < 1:
        raise ValueError("no alive Ray nodes")
    if stages < 1:
        raise ValueError(f"--stages must be >= 1, got {stages}")
    fit = num_nodes // stages
    count = replicas if replicas is not None else max(1, fit)
    if count < 1:
        raise ValueError(f"--replicas must be >= 1, got {count}")
    if count * stages > num_nodes and not allow_shared:
        raise ValueError(
            f"{count} replica(s) x {stages} stages need {count * stages} nodes but only {num_nodes} are alive; "
            "one stage per node (use fewer --stages/--replicas, or --allow-shared-nodes for testing)"
        )
    return [[(r * stages + s) % num_nodes for s in range(stages)] for r in range(count)]


def batch_sizes(requests: int, largest: int | None = None) -> list[int]:
    """Micro-batch sizes for ``--sweep batch``: powers of two up to the number of requests (or ``largest``)."""
    top = min(requests, largest) if largest else requests
    sizes = []
    size = 1
    while size <= top:
        sizes.append(size)
        size *= 2
    return sizes


def scaling_efficiency(tokens_per_s: Sequence[float]) -> list[float]:
    """Efficiency of each point of a 1..N node sweep against linear scaling: tps_n / (n * tps_1)."""
    if not tokens_per_s:
        return []
    base = tokens_per_s[0]
    return [(tps / (n * base) if base > 0 else 0.0) for n, tps in enumerate(tokens_per_s, start=1)]


def predicted_busy(unit_costs: Sequence[float], start: int, end: int, micro_batches: int) -> float:
    """Busy time a stage holding units [start, end) should accumulate over ``micro_batches`` micro-batches.

    ``unit_costs`` are per micro-batch (prefill and every decode step) on the stage's node.
    """
    return sum(unit_costs[start:end]) * micro_batches


def ceiling_tokens_per_s(tokens_per_replica: Sequence[int], busiest_per_replica: Sequence[float]) -> float:
    """The pipeline ceiling: each replica's tokens over its slowest stage's busy time, summed.

    A pipeline cannot produce faster than its bottleneck stage computes; this is the throughput
    with that stage busy 100 % of the time and every transfer hidden.
    """
    total = 0.0
    for tokens, busiest in zip(tokens_per_replica, busiest_per_replica, strict=True):
        if busiest > 0:
            total += tokens / busiest
    return total


def ceiling_gap(wall_s: float, stage: dict[str, Any]) -> dict[str, Any]:
    """Where the wall time of a run goes on one stage (its busiest): ``wall = busy + idle_in_span + outside_span``.

    ``outside_span_s`` is the wall time before the stage's first forward and after its last: the
    pipeline filling (the first micro-batch's prefill through the stages before it) and draining.
    ``idle_in_span_s`` is the time it waited for work in between (Ray's per-call work on its own
    process, and its upstream running late).  Both are measured on the stage's own clock, so
    clock skew between nodes does not enter.  With the stage's call times (``idle_fill_s`` ...,
    ``metrics.idle_breakdown``) the outside part is split into filling and draining, and the
    between-call idle per fifth of the run is passed on.
    """
    busy = float(stage["busy_s"])
    span = float(stage.get("span_s") or 0.0)
    gap: dict[str, Any] = {
        "stage": stage.get("host", stage.get("node_ip")),
        "busy_s": busy,
        "outside_span_s": max(0.0, wall_s - span) if span else None,
        "idle_in_span_s": max(0.0, span - busy) if span else None,
    }
    for key in ("idle_fill_s", "idle_between_s", "idle_drain_s", "idle_between_windows_s", "quota_used"):
        if stage.get(key) is not None:
            gap[key] = stage[key]
    return gap


def in_flight_limit(
    stages: int,
    requests: int,
    micro_batch: int,
    rate: float | None,
    asked: int | None = None,
    replicas: int = 1,
) -> int:
    """Micro-batches a replica keeps in flight: ``asked``, else a default; never fewer than stages + 1.

    Offline (``rate`` None) every request is there at once.  The default then splits each replica's
    micro-batches into equal waves of at most 4 x stages: a replica runs ``limit`` micro-batches side
    by side, each replaced by the next as it completes, so the last wave runs with only what is left
    in flight.  With a plain cap of 12 on 3 stages, 16 micro-batches ran as 12 and then a tail of 4,
    during which the busiest stage waited for the quota-limited ones (measured: 2.6 s of its 5.1 s
    idle fell in the last fifth of the run); as 8 + 8 every wave keeps 8 in flight.  Fewer than 4 x
    stages are all admitted at once.  Under Poisson arrivals the default stays 2 x stages (latency:
    a deeper queue only adds waiting).
    """
    if asked is not None:
        return max(asked, stages + 1)
    floor = max(stages + 1, 2 * stages)
    if rate is None:
        batches = -(-requests // max(1, micro_batch))
        per_replica = -(-batches // max(1, replicas))
        waves = max(1, -(-per_replica // (4 * stages)))
        return max(floor, -(-per_replica // waves))
    return floor
