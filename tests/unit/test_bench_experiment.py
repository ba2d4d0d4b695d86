"""The driver-side decisions that need no Ray: splits per spec and the pilot-run correction."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from raycluster_cli.bench import experiment, pilots
from raycluster_cli.bench.options import BenchOptions


def _stage(
    replica: int, node: str, units: tuple[int, int], busy: float, capacity: float | None = None
) -> SimpleNamespace:
    return SimpleNamespace(
        replica=replica, node_id=node, units=list(units), busy_s=busy, capacity_s=busy if capacity is None else capacity
    )


def test_choose_ranges() -> None:
    row = [0.1] + [1.0] * 6 + [0.1]
    assert experiment.choose_ranges("even", [row, row], 6, 0.0) == [(0, 4), (4, 8)]
    assert experiment.choose_ranges("manual:2,4", [row, row], 6, 0.0) == [(0, 3), (3, 8)]
    slow = [4 * c for c in row]
    ranges = experiment.choose_ranges("balanced", [row, slow], 6, 0.0)
    assert ranges == [(0, 6), (6, 8)]  # 5 blocks on the fast node, 1 on the slow one
    with pytest.raises(ValueError, match="3 stages but 2"):
        experiment.choose_ranges("manual:2,2,2", [row, row], 6, 0.0)


def test_pilot_factors_compare_each_stage_with_the_calibration() -> None:
    calibrated = {"a": [0.0, 1.0, 1.0, 1.0, 1.0, 0.0], "b": [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]}
    pilot = SimpleNamespace(
        replicas=[SimpleNamespace(index=0, micro_batches=2, busiest_s=12.0)],
        stages=[_stage(0, "a", (0, 3), 12.0), _stage(0, "b", (3, 6), 2.0)],
    )
    # a: predicted 2 blocks x 2 micro-batches = 4 s, measured 12 -> x3; b: 2 of a predicted 4 -> x0.5.
    assert pilots.pilot_factors(calibrated, pilot) == {"a": pytest.approx(3.0), "b": pytest.approx(0.5)}
    assert calibrated["a"][1] == 1.0  # the calibration itself is left alone
    # A quota stage that computed in bursts (busy 2 s) but spent CPU worth 8 s of its quota: 8 s counts.
    pilot.stages = [_stage(0, "a", (0, 3), 12.0), _stage(0, "b", (3, 6), 2.0, capacity=8.0)]
    assert pilots.pilot_factors(calibrated, pilot)["b"] == pytest.approx(2.0)


class _FakePipeline:
    """Two nodes with true per-block costs; a pilot's busy time is blocks x cost x micro-batches."""

    def __init__(self, true_cost: dict[str, float], noise: list[float] | None = None) -> None:
        self.true_cost = true_cost
        self.noise = noise or []
        self.runs: list[list[tuple[int, int]]] = []

    def __call__(self, ranges: list[list[tuple[int, int]]], index: int = 0) -> SimpleNamespace:
        self.runs.append(ranges[0])
        slow = self.noise[len(self.runs) - 1] if len(self.runs) <= len(self.noise) else 1.0
        busy = []
        for node, (a, b) in zip(("a", "b"), ranges[0], strict=True):
            blocks = min(b, 7) - max(a, 1)
            busy.append(blocks * self.true_cost[node] * 2 * (slow if node == "a" else 1.0))
        stages = [_stage(0, n, r, t) for n, r, t in zip(("a", "b"), ranges[0], busy, strict=True)]
        replica = SimpleNamespace(index=0, micro_batches=2, busiest_s=max(busy))
        summary = {"tokens_per_s": 100.0 / max(busy), "imbalance": (max(busy) - min(busy)) / (sum(busy) / 2)}
        return SimpleNamespace(replicas=[replica], stages=stages, summary=lambda: summary)


def _solver(costs: dict[str, list[float]]) -> object:
    return lambda: [experiment.choose_ranges("balanced", [costs["a"], costs["b"]], 6, 0.0)]


def test_refine_converges_to_the_true_split_and_stops_when_it_repeats() -> None:
    # Calibration says equal nodes; really b is 2x slower: 4 blocks on a, 2 on b is balanced.
    costs = {"a": [0.0] + [1.0] * 6 + [0.0], "b": [0.0] + [1.0] * 6 + [0.0]}
    fake = _FakePipeline({"a": 1.0, "b": 2.0})
    solve = _solver(costs)
    ranges, tried = pilots.refine(solve(), 5, fake, costs, solve)
    tried = pilots.public(tried, ranges, {})
    assert ranges == [[(0, 5), (5, 8)]]  # 4 blocks on a, 2 on b
    assert fake.runs[0] == [(0, 4), (4, 8)] and fake.runs[-1] == [(0, 5), (5, 8)]
    assert len(tried) < 5  # stopped once the same split was measured twice and solved again
    assert [t["chosen"] for t in tried] == [t["partition_ranges"] == [list(r) for r in ranges[0]] for t in tried]


def test_refine_averages_the_pilots_so_one_disturbed_pilot_does_not_decide() -> None:
    # Really b is 2x slower. Pilot 2 measures node a 3x slower than it is (outside load): alone,
    # that correction would move blocks onto b; averaged with the other pilots it does not stick.
    costs = {"a": [0.0] + [1.0] * 6 + [0.0], "b": [0.0] + [1.0] * 6 + [0.0]}
    fake = _FakePipeline({"a": 1.0, "b": 2.0}, noise=[1.0, 3.0, 1.0, 1.0])
    solve = _solver(costs)
    ranges, tried = pilots.refine(solve(), 4, fake, costs, solve)
    tried = pilots.public(tried, ranges, {})
    assert fake.runs[1] == [(0, 5), (5, 8)]  # the right split, measured while a was disturbed
    assert ranges == [[(0, 5), (5, 8)]]
    assert [t["chosen"] for t in tried] == [t["partition_ranges"] == [list(r) for r in ranges[0]] for t in tried]
    assert tried[1]["factors"]["a"] == pytest.approx(3.0)
    assert tried[-1]["mean_factors"]["a"] < tried[1]["mean_factors"]["a"]  # the outlier weighs less and less


def _measured(tokens_per_s: float) -> SimpleNamespace:
    stages = [_stage(0, "a", (0, 4), 1.0), _stage(0, "b", (4, 8), 1.0)]
    return SimpleNamespace(stages=stages, summary=lambda: {"tokens_per_s": tokens_per_s, "imbalance": 0.0})


def test_the_even_split_is_used_when_it_measured_faster_in_its_pilot() -> None:
    balanced, even = [[(0, 5), (5, 8)]], [[(0, 4), (4, 8)]]
    tried = [{"ranges": balanced, "tokens_per_s": 90.0}]
    used, choice = pilots.pick_split(balanced, even, tried, lambda: _measured(100.0))
    assert used == even and choice["used"] == "even" and "100.0" in choice["reason"]
    assert choice["even_pilot_tokens_per_s"] == 100.0 and choice["balanced_pilot_tokens_per_s"] == 90.0
    used, choice = pilots.pick_split(balanced, even, tried, lambda: _measured(80.0))
    assert used == balanced and choice["used"] == "balanced"


def test_no_even_pilot_when_the_balanced_split_is_the_even_one() -> None:
    even = [[(0, 4), (4, 8)]]

    def never() -> SimpleNamespace:
        raise AssertionError("no even pilot needed")

    used, choice = pilots.pick_split(even, even, [{"ranges": even, "tokens_per_s": 1.0}], never)
    assert used == even and "is the even split" in choice["reason"]


def test_auto_layers_gives_the_slowest_node_its_share() -> None:
    # Quotas 1.0 / 0.25 / 0.25: speeds 4:1:1, so 8 blocks on each slow node means 48 in all.
    assert experiment.auto_layers([[1.0, 4.0, 4.0]], 8) == 48
    assert experiment.auto_layers([[1.0, 2.0, 4.0]], 8) == 56
    assert experiment.auto_layers([[1.0, 1.0, 1.0]], 2) == experiment.MIN_AUTO_LAYERS
    assert experiment.auto_layers([[1.0, 1e6]], 8) == experiment.MAX_AUTO_LAYERS
    assert experiment.auto_layers([[1.0, 1.0], [1.0, 3.0]], 4) == 16  # the most unequal replica decides


def test_requests_fill_the_duration_in_whole_micro_batches() -> None:
    options = BenchOptions(max_new_tokens=10, micro_batch=4)
    # 100 tokens/s for 20 s = 2000 tokens = 200 requests of 10 tokens = 50 micro-batches of 4.
    assert experiment.requests_for(20.0, 100.0, options, 16) == 200
    assert experiment.requests_for(0.0, 100.0, options, 16) == 16
