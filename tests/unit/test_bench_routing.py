"""Speed-weighted routing: a replica k× faster gets k× the requests; equal routing is round-robin."""

from __future__ import annotations

import pytest

from raycluster_cli.bench.routing import assign, counts


def test_a_four_times_faster_replica_gets_four_times_the_requests() -> None:
    assert counts(assign(50, [1.0, 4.0]), 2) == [40, 10]


def test_weighted_finishes_every_replica_within_one_request() -> None:
    seconds = [1.0, 2.0, 4.0]
    found = counts(assign(70, seconds), 3)
    ends = [n * s for n, s in zip(found, seconds, strict=True)]
    assert sum(found) == 70 and max(ends) - min(ends) <= max(seconds)


def test_equal_is_round_robin() -> None:
    assert assign(7, [1.0, 4.0, 2.0], "equal") == [0, 1, 2, 0, 1, 2, 0]


def test_bad_input_is_refused_with_its_reason() -> None:
    with pytest.raises(ValueError, match="positive"):
        assign(3, [1.0, 0.0])
    with pytest.raises(ValueError, match="no replica"):
        assign(3, [])
    with pytest.raises(ValueError, match="'fastest'"):
        assign(3, [1.0], "fastest")
