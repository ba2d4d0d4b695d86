"""Balance and latency maths for the benchmark.  Pure Python, no torch.

``busy`` values are per-stage compute times (seconds spent inside forward passes) over the same
wall-clock window; their spread says how well the pipeline is balanced.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


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
    """
    if quota_cpus is None or quota_cpus <= 0:
        return float(busy_s)
    share = max(quota_cpus - max(0.0, others_cpus), 0.1 * quota_cpus)
    return max(float(busy_s), float(cpu_s) / share)


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
