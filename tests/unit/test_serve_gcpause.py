"""The serving processes' garbage collection: the start-up heap frozen, full collections counted and timed."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from raycluster_cli.node.gcpause import FullCollections, freeze_heap


@pytest.fixture
def thawed() -> Iterator[None]:
    yield
    gc.unfreeze()  # the rest of the test run collects as before


def test_freezing_leaves_a_full_collection_only_what_came_after(thawed: None) -> None:
    held = [[i] for i in range(50_000)]  # a start-up heap
    frozen = freeze_heap()
    assert frozen >= len(held) and gc.get_freeze_count() == frozen
    # a full collection now walks what came since, not the frozen heap
    assert len(gc.get_objects(generation=2)) < len(held)


def test_a_status_does_not_count_the_frozen_heap_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting the frozen objects walks them all (~3 ms for 400 000): the count is the one taken at the freeze."""

    def walk() -> int:
        raise AssertionError("gc.get_freeze_count() walked the frozen heap in a status call")

    monkeypatch.setattr(gc, "get_freeze_count", walk)
    watch = FullCollections(385_362)
    try:
        assert watch.summary()["frozen_objects"] == 385_362
    finally:
        watch.close()


def test_full_collections_are_counted_and_timed_and_young_ones_are_not() -> None:
    watch = FullCollections()
    try:
        assert watch.summary()["full_collections"] == 0 and watch.summary()["max_ms"] is None
        gc.collect(0)
        gc.collect(1)
        assert watch.count == 0  # only the oldest generation's collections pause for the whole heap
        gc.collect()
        gc.collect(2)
        summary = watch.summary()
        assert summary["full_collections"] == 2 and summary["total_s"] > 0
        assert 0 < summary["p50_ms"] <= summary["max_ms"]
    finally:
        watch.close()
    gc.collect()
    assert watch.count == 2  # closed: no longer called
