"""Arrivals, routing, replica placement and the derived benchmark numbers, worked out by hand."""

from __future__ import annotations

import random
import statistics
from collections import Counter

import pytest

from raycluster_cli.bench.planning import (
    arrival_times,
    batch_sizes,
    ceiling_gap,
    ceiling_tokens_per_s,
    in_flight_limit,
    power_of_two_choice,
    predicted_busy,
    replica_nodes,
    scaling_efficiency,
)
from raycluster_cli.node.cgroup import cgroup_cpu_usage_s, cpu_quota, torch_threads


def test_offline_arrivals_are_all_at_zero() -> None:
    assert arrival_times(4, None, 0) == [0.0] * 4


def test_poisson_arrivals_have_the_asked_rate() -> None:
    times = arrival_times(4000, 20.0, seed=3)
    assert times == sorted(times) and times[0] > 0
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert statistics.mean(gaps) == pytest.approx(1 / 20.0, rel=0.05)
    assert arrival_times(10, 20.0, seed=3) == times[:10]  # reproducible from the seed
    with pytest.raises(ValueError, match="must be > 0"):
        arrival_times(3, 0.0, 0)


def test_power_of_two_choices_picks_the_less_loaded_of_two() -> None:
    rng = random.Random(0)
    assert power_of_two_choice([2], [9, 9, 0], rng) == 2
    assert all(power_of_two_choice([0, 1], [5, 1], rng) == 1 for _ in range(20))
    # the most loaded replica is never chosen when two are sampled
    picks = Counter(power_of_two_choice([0, 1, 2], [0, 3, 10], rng) for _ in range(300))
    assert picks[2] == 0 and picks[0] > picks[1] > 0
    with pytest.raises(ValueError):
        power_of_two_choice([], [], rng)


def test_routing_keeps_replicas_balanced() -> None:
    rng = random.Random(1)
    loads = [0, 0, 0, 0]
    for _ in range(400):
        loads[power_of_two_choice(range(4), loads, rng)] += 1
    assert max(loads) - min(loads) <= 2


def test_replica_nodes() -> None:
    assert replica_nodes(3, 3, None, False) == [[0, 1, 2]]
    assert replica_nodes(3, 1, None, False) == [[0], [1], [2]]
    assert replica_nodes(5, 2, None, False) == [[0, 1], [2, 3]]
    assert replica_nodes(1, 1, 3, True) == [[0], [0], [0]]
    assert replica_nodes(2, 3, None, True) == [[0, 1, 0]]
    with pytest.raises(ValueError, match="allow-shared-nodes"):
        replica_nodes(2, 3, None, False)
    with pytest.raises(ValueError, match="allow-shared-nodes"):
        replica_nodes(3, 1, 4, False)
    with pytest.raises(ValueError, match="no alive"):
        replica_nodes(0, 1, None, False)


def test_sweep_helpers_and_ceiling() -> None:
    assert batch_sizes(10) == [1, 2, 4, 8]
    assert batch_sizes(32, largest=4) == [1, 2, 4]
    assert scaling_efficiency([100.0, 150.0, 240.0]) == pytest.approx([1.0, 0.75, 0.8])
    assert scaling_efficiency([]) == []
    assert predicted_busy([1.0, 2.0, 2.0, 0.5], 1, 3, micro_batches=4) == pytest.approx(16.0)
    # two replicas: 100 tokens with a 2 s bottleneck, 60 with 3 s -> 50 + 20 tokens/s
    assert ceiling_tokens_per_s([100, 60], [2.0, 3.0]) == pytest.approx(70.0)
    assert ceiling_tokens_per_s([10], [0.0]) == 0.0


def test_torch_threads_follow_the_cpus_ray_advertises() -> None:
    assert torch_threads(0.25, 2) == 1  # a fractional quota is one thread, not every core
    assert torch_threads(0.6, 16) == 1
    assert torch_threads(1.0, 16) == 1
    assert torch_threads(2.5, 16) == 3
    assert torch_threads(8.0, 4) == 4  # never more than the cores this process may use
    assert torch_threads(0.0, 4) == 4  # nothing advertised: the usable cores
    assert torch_threads(3.0, 0) == 1


def test_a_fractional_cfs_quota_is_one_thread_even_when_ray_advertises_none() -> None:
    # Ray truncates --cpus=0.25 / 0.6 to 0 CPUs; the quota itself says one thread.
    assert torch_threads(0.0, 2, quota_cpus=0.25) == 1
    assert torch_threads(0.0, 2, quota_cpus=0.6) == 1
    assert torch_threads(1.0, 16, quota_cpus=2.5) == 3
    assert torch_threads(4.0, 16, quota_cpus=None) == 4


def test_cpu_quota_parses_cgroup_v2_and_v1() -> None:
    assert cpu_quota(cpu_max="25000 100000\n") == 0.25
    assert cpu_quota(cpu_max="max 100000\n") is None
    assert cpu_quota(cpu_max="garbage") is None
    assert cpu_quota(cfs_quota_us="60000\n", cfs_period_us="100000\n") == 0.6
    assert cpu_quota(cfs_quota_us="-1", cfs_period_us="100000") is None
    assert cpu_quota() is None


def test_in_flight_offline_admits_every_micro_batch_up_to_four_per_stage() -> None:
    assert in_flight_limit(3, 32, 4, None) == 8  # 8 micro-batches: all at once, no starved tail
    assert in_flight_limit(3, 8, 4, None) == 6  # never below 2 x stages
    assert in_flight_limit(3, 400, 4, None) == 12  # capped at 4 x stages
    assert in_flight_limit(3, 32, 4, 2.0) == 6  # Poisson: 2 x stages
    assert in_flight_limit(3, 32, 4, None, asked=2) == 4  # asked, but at least stages + 1
    assert in_flight_limit(1, 1, 4, None) == 2


def test_in_flight_offline_splits_the_micro_batches_into_equal_waves() -> None:
    # session 7: 64 requests of 4 on 3 stages ran as 12 + a tail of 4; equal waves keep 8 in flight
    assert in_flight_limit(3, 64, 4, None) == 8  # 16 micro-batches: 8 + 8
    assert in_flight_limit(3, 72, 4, None) == 9  # 18: 9 + 9
    assert in_flight_limit(3, 76, 4, None) == 10  # 19: 10 + 9
    assert in_flight_limit(3, 100, 4, None) == 9  # 25: 9 + 9 + 7
    assert in_flight_limit(3, 48, 4, None) == 12  # 12: one wave, all at once
    assert in_flight_limit(3, 52, 4, None) == 7  # 13: 7 + 6, never below 2 x stages
    assert in_flight_limit(3, 128, 4, None, replicas=2) == 8  # 16 per replica
    assert in_flight_limit(3, 64, 4, 2.0) == 6  # Poisson arrivals: unchanged
    for batches in range(1, 200):  # waves of at most 4 x stages; the last short by fewer than there are waves
        limit = in_flight_limit(3, 4 * batches, 4, None)
        waves = -(-batches // limit)
        last = batches - limit * (waves - 1)
        assert limit <= 12 and (waves == 1 or last > limit - waves), batches


def test_ceiling_gap_splits_the_wall_time_of_the_busiest_stage() -> None:
    gap = ceiling_gap(10.0, {"node_ip": "192.0.2.2", "busy_s": 8.0, "span_s": 9.5})
    assert gap == {"stage": "192.0.2.2", "busy_s": 8.0, "outside_span_s": pytest.approx(0.5), "idle_in_span_s": 1.5}
    assert ceiling_gap(10.0, {"busy_s": 8.0})["outside_span_s"] is None  # an older stage report without a span
    stage = {"busy_s": 8.0, "span_s": 9.5, "idle_fill_s": 0.2, "idle_between_s": 1.5, "idle_drain_s": 0.3}
    gap = ceiling_gap(10.0, {**stage, "idle_between_windows_s": [0.3] * 5, "quota_used": 0.8})
    assert (gap["idle_fill_s"], gap["idle_between_s"], gap["idle_drain_s"], gap["quota_used"]) == (0.2, 1.5, 0.3, 0.8)
    assert gap["idle_between_windows_s"] == [0.3] * 5


def test_cgroup_cpu_usage() -> None:
    v2 = "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\nnr_periods 10\n"
    assert cgroup_cpu_usage_s(cpu_stat=v2) == pytest.approx(2.5)
    assert cgroup_cpu_usage_s(cpuacct_usage="25078290647\n") == pytest.approx(25.078290647)  # v1, nanoseconds
    assert cgroup_cpu_usage_s(cpu_stat="nr_periods 3\n") is None
    assert cgroup_cpu_usage_s(cpuacct_usage="garbage") is None
    assert cgroup_cpu_usage_s() is None
