"""The drained marks in a real GCS (``serve.fleet.GcsMarks`` on a throwaway local Ray): what one ingress saves,
another one reads; none saved reads as none; the store's calls answer within their deadline."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = [pytest.mark.slow]

ray = pytest.importorskip("ray")

from raycluster_cli.serve.fleet import GcsMarks  # noqa: E402

from ..local_ray import one_node_ray  # noqa: E402


def test_marks_saved_by_one_store_are_read_by_another_and_cleared() -> None:
    async def run() -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        before = await GcsMarks().load()
        await GcsMarks().save({"10.0.0.2": 1765000000.5, "node-abc": 2.0})
        read = await GcsMarks().load()  # a second store, as the next ingress's
        await GcsMarks().save({})
        return before, read, await GcsMarks().load()

    with one_node_ray(num_cpus=1):
        before, read, after = asyncio.run(run())
    assert before == {} and read == {"10.0.0.2": 1765000000.5, "node-abc": 2.0} and after == {}
