"""Balance and latency maths for the benchmark.  Pure Python, no torch.

``busy`` values are per-stage compute times (seconds spent inside forward passes) over the same
wall-clock window; their spread says how well the pipeline is balanced.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any


def _checked(values: Sequence[float], what: str) -> list[float]:
    out = [float(v) for v in values]
    if not out:
        raise ValueError(f"{what} needs at least one value")
    if any(math.isnan(v) or v < 0 for v in out):
        raise ValueError(f"{what} values must be non-negative numbers, got {out}")
    return out


def imbalance(busy: Sequence[float]) -> float:
    """(Tmax - Tmin) / Tmean: 0 for a perfectly balanced pipeline; 0 when nothing ran at all."""
    values = _checked(busy, "imbalance")
    mean = sum(values) / len(values)
    if mean == 0:
        return 0.0
    return (max(values) - min(values)) / mean


def capacity_time(busy_s: float, cpu_s: float, quota_cpus: float | None, others_cpus: float = 0.0) -> float:
    """A stage's busy time measured against its node's CPU allowance: max(busy, CPU time / quota).

    Under a CFS quota a stage that waits for work starts each call with unspent quota and computes
    at full core speed until the quota of the scheduler period is gone, so its wall-clock busy time
    understates what its work costs the node: ``cpu_s`` CPU-seconds take at least ``cpu_s / quota``
    seconds of wall time once the quota binds (a saturated stage).  Without a quota, or when the
    node was slower than its quota (starved by other load), the wall-clock busy time stands.

    ``others_cpus`` is the CPU rate the container's other processes used meanwhile (on the head: the
    driver, the GCS, the dashboard); they draw on the same quota, so the stage's share is what they
    leave (never taken below a tenth of the quota, against a bad reading).

    ``cpu_s`` is all the CPU the stage's process used over the run, not only inside its forward
    passes: Ray's per-call work in that process (receiving the step, sending its output on) is paid
    from the same quota.  On a 0.25-CPU node it was 0.64 of 4.8 CPU-s (about 2 ms per call), worth
    2.8 s of the quota's wall time; left out, the split gave those nodes 13 % too much work and
    they, not the busiest stage by wall clock, set the pace (docs/PERFORMANCE.md).
    """
    if quota_cpus is None or quota_cpus <= 0:
        return float(busy_s)
    share = max(quota_cpus - max(0.0, others_cpus), 0.1 * quota_cpus)
    return max(float(busy_s), float(cpu_s) / share)


def capacity_costs(calibration: Mapping[str, Any]) -> dict[str, Any]:
    """A node's calibration (``StageWorker.calibrate``) with each unit type's seconds as capacity time.

    ``capacity_time`` of each type's CPU seconds against the node's quota, with the busy time the node
    would take unhindered (its CPU seconds over its torch threads) in place of the wall clock: every node
    is timed at once, and on shared cores (a lab on one machine, other tenants) a node then gets less
    than its quota, so its wall clock shows the contention of the moment, not the node.  On the
    1.0 / 0.5 / 0.25-CPU lab under load the wall clock saw 1 : 1.1 : 1.3 and serve's split put as many
    blocks on the 0.25-CPU node as on the 0.5; serving, the stages then ran 1 : 2 : 4, the
    quotas.  Without a quota or CPU reading, or on a GPU (whose work is not this process's CPU time),
    the wall-clock seconds stand.  The wall-clock figures stay under ``<type>_wall_s``.
    """
    out = dict(calibration)
    quota = calibration.get("cpu_quota")
    threads = calibration.get("num_threads") or 1
    for kind in ("embedding", "block", "head"):
        wall, cpu = calibration.get(f"{kind}_s"), calibration.get(f"{kind}_cpu_s")
        out[f"{kind}_wall_s"] = wall
        if wall is not None and cpu is not None and quota and calibration.get("device", "cpu") == "cpu":
            out[f"{kind}_s"] = capacity_time(float(cpu) / float(threads), float(cpu), float(quota))
    return out


def spread(busy: Sequence[float]) -> float:
    """Tmax - Tmin in the units of ``busy``."""
    values = _checked(busy, "spread")
    return max(values) - min(values)


def utilisation(busy: Sequence[float]) -> float:
    """sum(T_i) / (N * Tmax): the fraction of the slowest stage's time the average stage is busy.

    1.0 means every stage works as long as the bottleneck; 0 when nothing ran at all.
    """
    values = _checked(busy, "utilisation")
    peak = max(values)
    if peak == 0:
        return 0.0
    return sum(values) / (len(values) * peak)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    data = sorted(float(v) for v in values)
    if not data:
        raise ValueError("percentile of an empty sequence")
    rank = (len(data) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (rank - low)


def latency_summary(values: Sequence[float]) -> dict[str, float | None]:
    """``{"p50", "p90", "p99"}`` of the values; all None when there are none (JSON has no NaN)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99)}


def relative_spread(values: Sequence[float]) -> float | None:
    """(max - min) / mean of repeated measurements of one figure; None with fewer than two (or mean 0)."""
    data = [float(v) for v in values]
    if len(data) < 2:
        return None
    mean = sum(data) / len(data)
    return (max(data) - min(data)) / mean if mean > 0 else None


def idle_breakdown(
    intervals: Sequence[Sequence[float]], wall_s: float, windows: int = 5
) -> dict[str, float | list[float]]:
    """Where a stage's idle time falls in a run of ``wall_s``, from its calls' (start, end) times.

    The times are seconds after the run's start on the stage's own clock.  ``idle_fill_s``: before its
    first call (the pipeline filling up to it); ``idle_drain_s``: after its last (the stages after it
    finishing); ``idle_between_s``: the gaps between calls (no work had reached it: its upstream or
    the driver running late, or every micro-batch queued elsewhere), also split over ``windows``
    equal slices of the run (``idle_between_windows_s``) to show whether it starves throughout or
    in the tail.  The three add up to the wall time not spent in calls.
    """
    spans = sorted((max(0.0, float(a)), max(float(a), float(b))) for a, b in intervals)
    per_window = [0.0] * max(1, windows)
    if not spans:
        return {
            "idle_fill_s": max(0.0, wall_s),
            "idle_between_s": 0.0,
            "idle_drain_s": 0.0,
            "idle_between_windows_s": per_window,
            "longest_gap_s": 0.0,
        }
    width = wall_s / len(per_window) if wall_s > 0 else 0.0
    between = longest = 0.0
    for (_, end), (start, _) in itertools.pairwise(spans):
        gap = max(0.0, start - end)
        between += gap
        longest = max(longest, gap)
        if width > 0:  # the gap's share of each slice it overlaps
            for w in range(len(per_window)):
                low, high = w * width, (w + 1) * width
                per_window[w] += max(0.0, min(start, high) - max(end, low))
    return {
        "idle_fill_s": min(spans[0][0], max(0.0, wall_s)),
        "idle_between_s": between,
        "idle_drain_s": max(0.0, wall_s - spans[-1][1]),
        "idle_between_windows_s": per_window,
        "longest_gap_s": longest,
    }


def quota_used(container_cpu_s: float | None, quota_cpus: float | None, wall_s: float) -> float | None:
    """The fraction of its CPU quota a container used over ``wall_s`` (1.0: the quota bound all along).

    None without a quota or a CPU reading.  Every process in the container counts: the stage's
    forward passes, Ray's per-call work in the stage's process, and Ray's daemons on that node.
    """
    if container_cpu_s is None or not quota_cpus or quota_cpus <= 0 or wall_s <= 0:
        return None
    return float(container_cpu_s) / (quota_cpus * wall_s)
