"""Balance and latency maths on numbers worked out by hand."""

from __future__ import annotations

import pytest

from raycluster_cli.placement import balance
from raycluster_cli.placement.balance import imbalance, latency_summary, percentile, spread, utilisation


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
    assert balance.capacity_time(5.45, 2.18, 0.25) == pytest.approx(8.72)  # bursts under a 0.25 quota
    assert balance.capacity_time(11.2, 2.69, 0.25) == pytest.approx(11.2)  # throttled: wall time stands
    assert balance.capacity_time(9.7, 6.5, 1.0) == pytest.approx(9.7)  # starved below its quota
    assert balance.capacity_time(3.0, 2.0, None) == 3.0  # no quota: busy time


def test_a_calibration_s_capacity_is_its_cpu_time_against_what_the_node_may_use() -> None:
    cal = {"embedding_s": 0.01, "block_s": 0.24, "head_s": 0.02, "block_cpu_s": 0.06, "num_threads": 1}
    cal |= {"embedding_cpu_s": 0.002, "head_cpu_s": 0.004, "device": "cpu"}
    quarter = balance.capacity_costs({**cal, "cpu_quota": 0.25})
    assert quarter["block_s"] == pytest.approx(0.24) and quarter["block_wall_s"] == 0.24  # CPU / quota
    assert balance.capacity_costs({**cal, "cpu_quota": 1.0})["block_s"] == pytest.approx(0.06)  # contended wall no more
    two = balance.capacity_costs({**cal, "cpu_quota": 4.0, "num_threads": 2})
    assert two["block_s"] == pytest.approx(0.03)  # no more cores than its threads, however large the quota
    assert balance.capacity_costs({**cal, "cpu_quota": None})["block_s"] == 0.24  # no quota: the wall clock
    assert balance.capacity_costs({"block_s": 0.24, "cpu_quota": 0.5})["block_s"] == 0.24  # no CPU reading


def test_capacity_time_leaves_the_quota_other_processes_used() -> None:
    # The head: a 0.6 quota of which the driver and the GCS used 0.1 -> the stage had 0.5.
    assert balance.capacity_time(18.0, 10.0, 0.6, others_cpus=0.1) == pytest.approx(20.0)
    assert balance.capacity_time(18.0, 10.0, 0.6, others_cpus=0.0) == pytest.approx(18.0)
    # A bad reading never makes the share vanish: at least a tenth of the quota.
    assert balance.capacity_time(1.0, 1.0, 0.5, others_cpus=5.0) == pytest.approx(20.0)
    assert balance.capacity_time(3.0, 2.0, None, others_cpus=0.5) == 3.0


def test_idle_breakdown_splits_idle_into_fill_between_and_drain() -> None:
    # a 10 s run: first call at 1.0, a 2 s gap at 4..6 (second and third fifths), last call ends at 9.5
    calls = [(1.0, 2.0), (2.0, 4.0), (6.0, 9.5)]
    got = balance.idle_breakdown(calls, 10.0, windows=5)
    assert got["idle_fill_s"] == pytest.approx(1.0)
    assert got["idle_between_s"] == pytest.approx(2.0)
    assert got["idle_drain_s"] == pytest.approx(0.5)
    assert got["idle_between_windows_s"] == pytest.approx([0.0, 0.0, 2.0, 0.0, 0.0])  # [4,6) is the third fifth
    assert got["longest_gap_s"] == pytest.approx(2.0)
    busy = sum(b - a for a, b in calls)
    assert got["idle_fill_s"] + got["idle_between_s"] + got["idle_drain_s"] == pytest.approx(10.0 - busy)


def test_idle_breakdown_gap_across_slices_and_unsorted_calls() -> None:
    got = balance.idle_breakdown([(7.0, 8.0), (0.0, 1.0)], 10.0, windows=5)  # gap 1..7 spans slices 0..3
    assert got["idle_between_windows_s"] == pytest.approx([1.0, 2.0, 2.0, 1.0, 0.0])
    assert got["idle_fill_s"] == 0.0 and got["idle_drain_s"] == pytest.approx(2.0)


def test_idle_breakdown_without_calls_is_all_fill() -> None:
    got = balance.idle_breakdown([], 4.0, windows=2)
    assert got["idle_fill_s"] == 4.0 and got["idle_between_s"] == 0.0 and got["idle_drain_s"] == 0.0
    assert got["idle_between_windows_s"] == [0.0, 0.0]


def test_quota_used() -> None:
    # the 0.25-CPU node of session 6: 5.27 CPU-s in a 21.5 s run is 98 % of its quota
    assert balance.quota_used(5.27, 0.25, 21.5) == pytest.approx(5.27 / 5.375)
    assert balance.quota_used(None, 0.25, 21.5) is None
    assert balance.quota_used(5.0, None, 21.5) is None
    assert balance.quota_used(5.0, 0.25, 0.0) is None


def test_stage_report_carries_the_idle_breakdown_and_the_quota_used() -> None:
    from raycluster_cli.bench.results import stage_report
    from raycluster_cli.models.config import ModelConfig

    cfg = ModelConfig(layers=4)
    info = {"node_ip": "192.0.2.3", "node_id": "n3", "num_threads": 1, "cpu_quota": 0.25}
    stat = {
        "busy_s": 8.0,
        "cpu_s": 2.0,
        "process_cpu_s": 2.2,
        "container_cpu_s": 2.4,
        "stats_wall_s": 10.0,
        "span_s": 9.0,
        "calls": 2,
        "intervals": [(0.5, 4.5), (5.5, 9.5)],
    }
    report = stage_report((0, 2), (3, 6), info, stat, cfg, 10.0, False)
    assert (report.idle_fill_s, report.idle_between_s, report.idle_drain_s) == pytest.approx((0.5, 1.0, 0.5))
    assert report.idle_s == pytest.approx(2.0) and report.quota_used == pytest.approx(2.4 / 2.5)
    old = stage_report((0, 2), (3, 6), info, {k: v for k, v in stat.items() if k != "intervals"}, cfg, 10.0, True)
    assert old.idle_fill_s is None and old.quota_used is None  # an older node image; a shared container
