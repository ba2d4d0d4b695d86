"""A pipeline's ring of direct links formed by the service's fleet (``RayFleet._connect``) on a throwaway local Ray,
its stages real stage actors: a stranger who tries every port the ring opened, in the engine's process and in the
stages', as torch's rendezvous store finds none that answers (nothing to list, nothing to write, no address record
to forge), and the ring then carries a real step."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # twins: the unit test on loopback, the lab test

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
psutil = pytest.importorskip("psutil")

from raycluster_cli.models.config import ModelConfig  # noqa: E402
from raycluster_cli.serve.fleet import RayFleet  # noqa: E402
from raycluster_cli.serve.scheduler import Limits  # noqa: E402
from raycluster_cli.serve.stages import start_stages  # noqa: E402

from ..local_ray import one_node_ray  # noqa: E402
from ..unit.test_serve_rendezvous import _store_answers  # noqa: E402


@pytest.fixture(scope="module")
def ray_node() -> Iterator[str]:
    with one_node_ray() as node_id:
        yield node_id


def _listening(pid: int) -> set[tuple[str, int]]:
    found = psutil.Process(pid).net_connections("tcp")
    return {(c.laddr.ip, c.laddr.port) for c in found if c.status == "LISTEN"}


def test_no_rendezvous_store_answers_a_stranger_and_the_ring_carries_a_step(ray_node: str) -> None:
    cfg = ModelConfig(vocab=97, d_model=32, heads=4, layers=2, max_seq=24, seed=5)
    limits = Limits(slots=2, step_tokens=8, prefill_chunk=8, max_seq=24)
    actors, _ = start_stages(cfg, [(0, 2), (2, 4)], limits.slots, num_threads=1, timeout_s=120)
    pids = [os.getpid(), *(int(c["pid"]) for c in ray.get([a.counters.remote() for a in actors], timeout=30))]
    before = {pid: _listening(pid) for pid in pids}
    fleet = RayFleet(cfg, None, limits, frozenset(), stages=2)

    async def form_and_step() -> tuple[set[tuple[str, int]], list[bool], torch.Tensor]:
        links, why = await fleet._connect(actors, limits)
        assert links is not None and why is None, why
        opened = set().union(*(_listening(pid) - before[pid] for pid in pids))
        with ThreadPoolExecutor(len(opened) or 1) as strangers:  # each tries as a process of its own, at once
            answered = list(strangers.map(lambda where: _store_answers(*where), sorted(opened)))
        ids, table = torch.tensor([[3, 5]]), torch.tensor([[0], [0], [2]])
        logits, _ = await asyncio.wait_for(links.run(ids, table), 30)
        links.close()
        return opened, answered, logits

    try:
        opened, answered, logits = asyncio.run(form_and_step())
    finally:
        for actor in actors:
            ray.kill(actor)
    assert len(opened) >= 3, opened  # gloo's listener in the engine and in each stage: every one was tried
    assert not any(answered), [where for where, yes in zip(sorted(opened), answered, strict=True) if yes]
    assert logits.shape == (1, cfg.vocab) and bool(torch.isfinite(logits).all())
