"""Balance and latency maths on numbers worked out by hand."""

from __future__ import annotations

import pytest

from raycluster_cli.bench import metrics
from raycluster_cli.bench.metrics import imbalance, latency_summary, percentile, spread, utilisation


def test_imbalance_and_utilisation() -> None:
    busy = [2.0, 3.0, 4.0]
    assert imbalance(busy) == pytest.approx((4 - 2) / 3)
    assert utilisation(busy) == pytest.approx(9 / (3 * 4))
    assert spread(busy) == pytest.approx(2.0)
    assert imbalance([5.0, 5.0]) == 0.0 and utilisation([5.0, 5.0]) == 1.0
    assert imbalance([0.0, 0.0]) == 0.0 and utilisation([0.0]) == 0.0
    assert imbalance([1.0]) == 0.0 and utilisation([1.0]) == 1.0


def test_percentile_linear_interpolation() -> None:
    values = [10.0, 1.0, 4.0, 2.0, 3.0]  # sorted: 1 2 3 4 10
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 100) == 10.0
    assert percentile(values, 90) == pytest.approx(4 + 0.6 * 6)
    assert percentile([1.0, 2.0], 25) == pytest.approx(1.25)
    assert percentile([7.0], 99) == 7.0


def test_summary() -> None:
    values = [float(i) for i in range(1, 101)]
    s = latency_summary(values)
    assert s == pytest.approx({"p50": 50.5, "p90": 90.1, "p99": 99.01})
    assert latency_summary([]) == {"p50": None, "p90": None, "p99": None}


def test_bad_input() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    with pytest.raises(ValueError):
        imbalance([])
    with pytest.raises(ValueError):
        utilisation([1.0, -1.0])


def test_capacity_time_charges_cpu_against_the_quota() -> None:
    assert metrics.capacity_time(5.45, 2.18, 0.25) == pytest.approx(8.72)  # bursts under a 0.25 quota
    assert metrics.capacity_time(11.2, 2.69, 0.25) == pytest.approx(11.2)  # throttled: wall time stands
    assert metrics.capacity_time(9.7, 6.5, 1.0) == pytest.approx(9.7)  # starved below its quota
    assert metrics.capacity_time(3.0, 2.0, None) == 3.0  # no quota: busy time


def test_capacity_time_leaves_the_quota_other_processes_used() -> None:
    # The head: a 0.6 quota of which the driver and the GCS used 0.1 -> the stage had 0.5.
    assert metrics.capacity_time(18.0, 10.0, 0.6, others_cpus=0.1) == pytest.approx(20.0)
    assert metrics.capacity_time(18.0, 10.0, 0.6, others_cpus=0.0) == pytest.approx(18.0)
    # A bad reading never makes the share vanish: at least a tenth of the quota.
    assert metrics.capacity_time(1.0, 1.0, 0.5, others_cpus=5.0) == pytest.approx(20.0)
    assert metrics.capacity_time(3.0, 2.0, None, others_cpus=0.5) == 3.0
