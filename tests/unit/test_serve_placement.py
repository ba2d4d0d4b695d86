"""Placement: replicas from the alive nodes, each split min-max over its nodes' measured costs (pure)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from raycluster_cli.placement.partition import stage_costs
from raycluster_cli.placement.pipelines import NodeSpeed, plan_replicas, replan, resplit, snake_groups, split_over

BLOCKS = 8


def _node(name: str, block_s: float) -> NodeSpeed:
    return NodeSpeed(f"id-{name}", f"10.0.0.{name}", (0.1 * block_s, *([block_s] * BLOCKS), 0.2 * block_s))


def test_floor_n_over_s_replicas_with_matched_speeds() -> None:
    nodes = [_node("1", 1.0), _node("2", 2.0), _node("3", 1.0), _node("4", 4.0), _node("5", 9.0)]
    plans = plan_replicas(nodes, stages=2)
    assert len(plans) == 2  # 5 // 2; the slowest node stays out
    used = {n for p in plans for n in p.node_ids}
    assert "id-5" not in used and len(used) == 4
    # snake order: fastest + slowest of the four in one replica, the two middle ones in the other
    assert sorted(sorted(p.ips) for p in plans) == [["10.0.0.1", "10.0.0.4"], ["10.0.0.2", "10.0.0.3"]]
    assert "2 replica(s)" in plans[0].why and "1 slowest node(s) unused" in plans[0].why


def test_each_replica_is_split_min_max_by_its_nodes_speed() -> None:
    fast, slow = _node("1", 1.0), _node("2", 3.0)
    (plan,) = plan_replicas([fast, slow], stages=2)
    blocks = [min(end, BLOCKS + 1) - max(start, 1) for start, end in plan.ranges]
    assert blocks == [6, 2]  # a node three times slower gets about a third of the fast one's blocks
    assert plan.stage_s == tuple(stage_costs([list(fast.unit_costs), list(slow.unit_costs)], list(plan.ranges)))
    stages = plan.to_json(BLOCKS)["stages"]
    assert [s["blocks"] for s in stages] == [6, 2] and stages[1]["node_ip"] == "10.0.0.2"


def test_a_given_split_and_too_few_nodes() -> None:
    plans = plan_replicas([_node("1", 1.0), _node("2", 1.0)], stages=1, split=[(0, BLOCKS + 2)])
    assert [p.ranges for p in plans] == [((0, BLOCKS + 2),)] * 2
    assert len(plan_replicas([_node("1", 1.0), _node("2", 1.0)], stages=1, replicas=1)) == 1
    with pytest.raises(ValueError, match="cannot hold a pipeline of 3 stages"):
        plan_replicas([_node("1", 1.0), _node("2", 1.0)], stages=3)


def test_a_replica_that_lost_a_node_is_re_split_over_survivors_and_free_nodes() -> None:
    alone = replan([_node("1", 1.0)], [], stages=2, num_blocks=BLOCKS)
    assert alone is not None and alone.ranges == ((0, BLOCKS + 2),)  # one survivor: the whole model
    filled = replan([_node("1", 1.0)], [_node("7", 5.0), _node("6", 1.0)], stages=2, num_blocks=BLOCKS)
    assert filled is not None and filled.node_ids == ("id-1", "id-6")  # the fastest free node joins
    assert replan([], [], stages=2, num_blocks=BLOCKS) is None


def test_snake_groups_deal_fast_and_slow_evenly() -> None:
    nodes = [_node(str(i), float(i)) for i in range(1, 7)]
    groups = snake_groups(nodes, replicas=3, stages=2)
    assert [[n.block_s for n in g] for g in groups] == [[1.0, 6.0], [2.0, 5.0], [3.0, 4.0]]


def test_memory_caps_each_stage_however_fast_its_node() -> None:
    """The fast node would take most blocks by speed; it holds only two, so the split gives it two."""
    from raycluster_cli.placement.partition import DoesNotFit

    fast = NodeSpeed("a", "10.0.0.1", (0.1, *([1.0] * 6), 0.1), capacity=230)
    slow = NodeSpeed("b", "10.0.0.2", (1.0, *([10.0] * 6), 1.0), capacity=10_000)
    sizes = [10, *([100] * 6), 10]
    by_speed = plan_replicas([NodeSpeed("a", "10.0.0.1", fast.unit_costs), slow], stages=2)[0]
    assert by_speed.ranges[0][1] - 1 >= 4
    [plan] = plan_replicas([fast, slow], stages=2, unit_bytes=sizes)
    assert plan.ranges == ((0, 3), (3, 8)) and "within each node's memory" in plan.why
    with pytest.raises(DoesNotFit, match=r"stage 0 \(units 0-4\) needs 0\.00 GB but 10\.0\.0\.1 holds"):
        plan_replicas([fast, slow], stages=2, split=[(0, 5), (5, 8)], unit_bytes=sizes)
    small = NodeSpeed("b", "10.0.0.2", slow.unit_costs, capacity=300)
    with pytest.raises(DoesNotFit, match=r"does not fit 2 stage\(s\) on 10\.0\.0\.1 0\.00 GB, 10\.0\.0\.2"):
        plan_replicas([fast, small], stages=2, unit_bytes=sizes)
    replanned = replan([fast], [slow], stages=2, num_blocks=6, unit_bytes=sizes)
    assert replanned is not None and replanned.ranges == ((0, 3), (3, 8))


def _blocks(ranges: tuple[tuple[int, int], ...]) -> list[int]:
    return [min(end, BLOCKS + 1) - max(start, 1) for start, end in ranges]


def test_a_stage_slower_under_load_than_its_calibration_gets_fewer_blocks() -> None:
    """Three equal nodes split 3/3/2; under load the first node's stage takes twice its modelled time (its
    container shares the CPU with the ingress): the re-split moves blocks off it, and is predicted faster."""
    nodes = [_node("1", 1.0), _node("2", 1.0), _node("3", 1.0)]
    (plan,) = plan_replicas(nodes, stages=3)
    measured = [2.0 * plan.stage_s[0], plan.stage_s[1], plan.stage_s[2]]
    found = resplit(plan, nodes, measured)
    assert found is not None
    new, corrected = found
    assert new.node_ids == plan.node_ids and _blocks(new.ranges)[0] < _blocks(plan.ranges)[0]
    assert max(new.stage_s) <= 0.85 * max(measured)
    assert corrected[0].unit_costs == tuple(2.0 * c for c in nodes[0].unit_costs) and corrected[1] == nodes[1]
    assert "x2.00" in new.why and "faster" in new.why


def test_a_pipeline_slowed_evenly_or_within_noise_is_left_alone() -> None:
    nodes = [_node("1", 1.0), _node("2", 2.0)]
    (plan,) = plan_replicas(nodes, stages=2)
    assert resplit(plan, nodes, [3.0 * s for s in plan.stage_s]) is None  # a bigger batch slows every stage
    assert resplit(plan, nodes, [1.05 * plan.stage_s[0], plan.stage_s[1]]) is None  # 5 %: not worth a rebuild
    assert resplit(plan, nodes[:1], [1.0]) is None and resplit(replace(plan, stage_s=()), nodes, [1.0, 2.0]) is None


def test_a_re_split_must_fit_beside_the_old_stage_on_each_node() -> None:
    """The new pipeline is built while the old one still holds its blocks: with only the old stage's bytes
    (plus one block) of room on the slow node, no re-split that gives it more blocks is offered."""
    unit_bytes = [10] + [100] * BLOCKS + [10]
    nodes = [_node("1", 1.0), _node("2", 1.0)]
    (plan,) = plan_replicas(nodes, stages=2)
    measured = [plan.stage_s[0], 3.0 * plan.stage_s[1]]  # the second node is slowed: blocks move to the first
    held = [sum(unit_bytes[a:b]) for a, b in plan.ranges]
    roomy = [replace(n, capacity=10_000) for n in nodes]
    assert resplit(plan, roomy, measured, unit_bytes) is not None
    tight = [replace(nodes[0], capacity=held[0] + 100), replace(nodes[1], capacity=10_000)]
    assert resplit(plan, tight, measured, unit_bytes) is None  # alone, its room would take the bigger stage
    alone = split_over([replace(n, capacity=10_000) for n in nodes], None, "", unit_bytes)
    assert alone.ranges == plan.ranges and held[0] + 100 >= sum(unit_bytes[: plan.ranges[0][1] + 1])
