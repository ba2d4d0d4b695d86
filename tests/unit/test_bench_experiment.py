"""The driver-side decisions that need no Ray: splits per spec and the pilot-run correction."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from raycluster_cli.bench import experiment


def _stage(replica: int, node: str, units: tuple[int, int], busy: float) -> SimpleNamespace:
    return SimpleNamespace(replica=replica, node_id=node, units=list(units), busy_s=busy)


def test_choose_ranges() -> None:
    row = [0.1] + [1.0] * 6 + [0.1]
    assert experiment.choose_ranges("even", [row, row], 6, 0.0) == [(0, 4), (4, 8)]
    assert experiment.choose_ranges("manual:2,4", [row, row], 6, 0.0) == [(0, 3), (3, 8)]
    slow = [4 * c for c in row]
    ranges = experiment.choose_ranges("balanced", [row, slow], 6, 0.0)
    assert ranges == [(0, 6), (6, 8)]  # 5 blocks on the fast node, 1 on the slow one
    with pytest.raises(ValueError, match="3 stages but 2"):
        experiment.choose_ranges("manual:2,2,2", [row, row], 6, 0.0)


def test_pilot_correction_slows_the_busiest_and_never_speeds_up_a_waiting_stage() -> None:
    costs = {"a": [0.0, 1.0, 1.0, 1.0, 1.0, 0.0], "b": [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]}
    pilot = SimpleNamespace(
        replicas=[SimpleNamespace(index=0, micro_batches=2, busiest_s=12.0)],
        stages=[_stage(0, "a", (0, 3), 12.0), _stage(0, "b", (3, 6), 2.0)],
    )
    # a: predicted 2 blocks x 2 micro-batches = 4 s, measured 12 -> x3; b: measured less than
    # predicted while waiting for a -> unchanged (a waiting stage may look faster than it is).
    factors = experiment._refine_costs(costs, pilot)
    assert factors == {"a": pytest.approx(3.0), "b": pytest.approx(1.0)}
    assert costs["a"][1] == pytest.approx(3.0) and costs["b"][1] == pytest.approx(1.0)
    # The busiest stage may also turn out faster than calibrated.
    pilot.stages = [_stage(0, "a", (0, 3), 2.0), _stage(0, "b", (3, 6), 1.0)]
    pilot.replicas[0].busiest_s = 2.0
    assert experiment._refine_costs(costs, pilot)["a"] == pytest.approx(2.0 / 12.0)
