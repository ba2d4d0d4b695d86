"""Stage splits: contiguous, never empty, and optimal for the modelled costs."""

from __future__ import annotations

import itertools
import random

import pytest

from raycluster_cli.placement.partition import (
    balanced_partition,
    blocks_held,
    boundary_costs,
    even_partition,
    manual_partition,
    stage_costs,
)


def _check_tiling(ranges: list[tuple[int, int]], num_blocks: int) -> None:
    assert ranges[0][0] == 0 and ranges[-1][1] == num_blocks + 2
    for (_, end), (start, _) in itertools.pairwise(ranges):
        assert end == start
    assert all(end > start for start, end in ranges)


def test_even_partition_shapes() -> None:
    assert even_partition(12, 3) == [(0, 5), (5, 9), (9, 14)]
    assert even_partition(12, 1) == [(0, 14)]
    assert [blocks_held(a, b, 10) for a, b in even_partition(10, 3)] == [4, 3, 3]
    assert [blocks_held(a, b, 5) for a, b in even_partition(5, 5)] == [1] * 5
    for layers in range(1, 9):
        for stages in range(1, layers + 1):
            ranges = even_partition(layers, stages)
            _check_tiling(ranges, layers)
            held = [blocks_held(a, b, layers) for a, b in ranges]
            assert sum(held) == layers and max(held) - min(held) <= 1 and min(held) >= 1


def test_manual_partition() -> None:
    assert manual_partition([4, 4, 4]) == [(0, 5), (5, 9), (9, 14)]
    assert manual_partition("2, 1,3", num_blocks=6) == [(0, 3), (3, 4), (4, 8)]
    assert [blocks_held(a, b, 3) for a, b in manual_partition([2, 1])] == [2, 1]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: even_partition(2, 3), "more stages than blocks"),
        (lambda: even_partition(4, 0), "at least one stage"),
        (lambda: even_partition(0, 1), "at least one block"),
        (lambda: manual_partition([4, 0, 4]), "at least one block"),
        (lambda: manual_partition("4,x"), "comma-separated"),
        (lambda: manual_partition([]), "at least one stage"),
        (lambda: manual_partition([4, 4], num_blocks=12), "holds 8 blocks"),
        (lambda: balanced_partition([[1.0] * 4] * 3), "more stages than blocks"),
        (lambda: balanced_partition([[1.0] * 5, [1.0] * 4]), "equal length"),
        (lambda: balanced_partition([[1.0, 1.0]]), "at least one block"),
        (lambda: balanced_partition([[1.0, -1.0, 1.0]]), ">= 0"),
        (lambda: balanced_partition([[1.0] * 5] * 2, [1.0, 2.0]), "one value per stage boundary"),
        (lambda: balanced_partition([]), "at least one stage"),
    ],
)
def test_bad_requests_raise(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]


def test_balanced_known_optimum() -> None:
    # emb 1, blocks 1..6 = [5, 1, 1, 1, 1, 5], head 3 on two identical nodes:
    # cut after unit 3 -> 8 | 10, after 4 -> 9 | 9 (optimal), after 5 -> 10 | 8.
    row = [1.0, 5.0, 1.0, 1.0, 1.0, 1.0, 5.0, 3.0]
    ranges = balanced_partition([row, row])
    assert ranges == [(0, 5), (5, 8)]
    assert stage_costs([row, row], ranges) == [9.0, 9.0]


def test_balanced_equal_nodes_equals_even_split() -> None:
    row = [0.0] + [1.0] * 12 + [0.0]
    assert balanced_partition([row] * 3) == even_partition(12, 3)
    assert balanced_partition([row] * 4) == even_partition(12, 4)


def test_slow_node_gets_fewer_blocks() -> None:
    fast = [0.1] + [1.0] * 12 + [0.5]
    slow = [4 * c for c in fast]
    ranges = balanced_partition([fast, slow, fast])
    _check_tiling(ranges, 12)
    held = [blocks_held(a, b, 12) for a, b in ranges]
    assert held[1] < held[0] and held[1] < held[2] and held[1] >= 1
    assert held == [6, 1, 5]
    assert max(stage_costs([fast, slow, fast], ranges)) == pytest.approx(6.1)
    # Is it really optimal?  Brute force every split into 3 non-empty block groups.
    best = min(
        max(stage_costs([fast, slow, fast], manual_partition([a, b, 12 - a - b])))
        for a in range(1, 11)
        for b in range(1, 12 - a)
    )
    assert max(stage_costs([fast, slow, fast], ranges)) == pytest.approx(best)


def test_transfer_cost_is_charged_to_sender() -> None:
    row = [0.0] + [1.0] * 4 + [0.0]
    # Boundary 0 costs 2: stage 0 should then hold fewer blocks.
    ranges = balanced_partition([row, row], [2.0])
    assert [blocks_held(a, b, 4) for a, b in ranges] == [1, 3]
    assert stage_costs([row, row], ranges, [2.0]) == [3.0, 3.0]


def test_balanced_may_allow_stages_without_blocks_when_asked() -> None:
    row = [0.0, 1.0, 1.0, 10.0]  # a huge head deserves a node of its own
    assert balanced_partition([row, row], min_blocks_per_stage=0) == [(0, 3), (3, 4)]
    assert balanced_partition([row, row]) == [(0, 2), (2, 4)]
    assert balanced_partition([row] * 4, min_blocks_per_stage=0) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_boundary_costs_split_each_transfer_between_its_two_ends() -> None:
    assert boundary_costs(2.0, 1) == [0.0]
    assert boundary_costs(2.0, 2) == [1.0, 1.0]
    assert boundary_costs(2.0, 4) == [1.0, 2.0, 2.0, 1.0]
    with pytest.raises(ValueError, match=">= 0"):
        boundary_costs(-1.0, 2)


def test_fixed_costs_move_blocks_away_from_the_middle() -> None:
    row = [0.0] + [1.0] * 9 + [0.0]
    # The middle stage touches two boundaries: with 3 per boundary it pays 3, the ends 1.5 each.
    # Without transfers 3/3/3 (max 6 with them); with them 3/2/4 -> 4.5, 5, 5.5.
    ranges = balanced_partition([row] * 3, fixed_cost=boundary_costs(3.0, 3))
    assert [blocks_held(a, b, 9) for a, b in ranges] == [3, 2, 4]
    assert max(stage_costs([row] * 3, ranges, fixed_cost=boundary_costs(3.0, 3))) == pytest.approx(5.5)
    with pytest.raises(ValueError, match="one value per stage"):
        balanced_partition([row] * 3, fixed_cost=[1.0])


@pytest.mark.parametrize("stages", [1, 2, 3, 5, 8])
def test_balanced_never_leaves_a_stage_empty(stages: int) -> None:
    rng = random.Random(stages)
    for _ in range(20):
        rows = [
            [rng.uniform(0, 3)] + [rng.uniform(0.1, 5) for _ in range(8)] + [rng.uniform(0, 20)] for _ in range(stages)
        ]
        ranges = balanced_partition(rows, fixed_cost=boundary_costs(rng.uniform(0, 2), stages))
        _check_tiling(ranges, 8)
        assert all(blocks_held(a, b, 8) >= 1 for a, b in ranges)
