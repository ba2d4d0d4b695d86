"""Direct links (node.links) over real gloo process groups on loopback: the engine and its stages as ranks of one
ring in this process (each rank its own group object, as the engine's process holds one per pipeline)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from raycluster_cli.node.links import (
    HEADER_BYTES,
    KIND_IDS,
    KIND_LOGITS,
    MIN_CAPACITY,
    DirectLinks,
    LinksDown,
    StageLoop,
    link_capacity,
)
from raycluster_cli.node.rendezvous import Joining, merged

pytest.importorskip("torch.distributed")

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _ring(
    forwards: list[Forward], secret: bytes = b"s3cret", capacity: int = MIN_CAPACITY
) -> tuple[list[Any], list[StageLoop]]:
    """[the engine's group (rank 0)] and a started loop per stage (ranks 1..n), all joined on loopback, their
    address records handed round in process as the engine hands them over Ray (node.rendezvous)."""
    size = len(forwards) + 1
    joining = [Joining(rank, size, "127.0.0.1") for rank in range(size)]
    records = merged([j.offer() for j in joining])
    groups: dict[int, Any] = {}

    def join(rank: int) -> None:
        groups[rank] = joining[rank].join(records, secret)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    loops = [StageLoop(groups[i + 1], i + 1, size, f, capacity) for i, f in enumerate(forwards)]
    for loop in loops:
        loop.start()
    return [groups[0]], loops


def _embed(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return ids.to(torch.float32)[..., None].expand(*ids.shape, 4) + table[0][:, None, None]


def _double(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return x * 2


def _logits(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return x[:, -1, :].to(torch.float16)  # [rows, vocab], in another dtype on the way back


# the ring's message size: every step fits in one message; or 158 bytes, so steps of 3 rows (and hidden states of 2)
# send their header alone and their body after it, between steps that fit, in the same order
@pytest.mark.parametrize("capacity", [MIN_CAPACITY, 158])
def test_steps_go_round_the_ring_in_order_and_come_back_as_logits(capacity: int) -> None:
    assert HEADER_BYTES + 3 * 8 * 2 + 2 * 8 * 2 < 158 < HEADER_BYTES + 3 * 8 * 3 + 3 * 8 * 2  # ids of 2 rows fit, 3 not
    engine_side, _ = _ring([_embed, _double, _logits], capacity=capacity)

    async def run() -> list[tuple[torch.Tensor, float]]:
        links = DirectLinks(engine_side.pop(), 4, capacity=capacity)
        links.start()
        steps = []
        for n in range(12):  # all in flight at once: they come back in the order they went
            rows = 1 + n % 3
            ids = torch.arange(rows * 2, dtype=torch.long).view(rows, 2) + n
            table = torch.tensor([[n] * rows, [0] * rows, [2] * rows], dtype=torch.long)
            steps.append(links.run(ids, table))
        return list(await asyncio.gather(*steps))

    began = time.time()
    results = asyncio.run(run())
    arrivals = [arrived for _, arrived in results]
    assert arrivals == sorted(arrivals) and began <= arrivals[0] <= time.time()  # the receive thread's clock, in order
    for n, (logits, _) in enumerate(results):
        rows = 1 + n % 3
        ids = torch.arange(rows * 2, dtype=torch.long).view(rows, 2) + n
        want = ((ids[:, -1].to(torch.float32) + n) * 2)[:, None].expand(rows, 4).to(torch.float16)
        assert logits.dtype == torch.float16 and torch.equal(logits, want)


def test_a_ring_s_capacity_holds_a_decode_step_of_its_most_rows() -> None:
    # 48 rows of Llama-3-8B's logits (128256 of them, float32) and their table of 11 rows (the sampling settings
    # after slot, start, length, every position's) fit one message; a tiny model gets the floor
    assert link_capacity(48, 4096, 128256) == HEADER_BYTES + 11 * 48 * 8 + 48 * 128256 * 4
    assert link_capacity(1, 8, 16) == MIN_CAPACITY


def test_a_stage_that_fails_ends_the_ring_and_the_engine_hears_of_it() -> None:
    def broken(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        raise ValueError("slot out of range")

    engine_side, loops = _ring([_embed, broken, _logits])

    async def run() -> BaseException:
        links = DirectLinks(engine_side.pop(), 4)  # the links own the engine's group: failing closes it
        links.start()
        ids, table = torch.zeros(1, 1, dtype=torch.long), torch.tensor([[0], [0], [1]])
        with pytest.raises(LinksDown) as failed:
            await asyncio.wait_for(links.run(ids, table), 30)
        with pytest.raises(LinksDown):  # and nothing more is sent
            await links.run(ids, table)
        return failed.value

    error = asyncio.run(run())
    assert "closed" in str(error).lower() or "peer" in str(error).lower()
    assert "ValueError: slot out of range" in loops[1].wait()
    assert all(loop.wait() for loop in loops)  # every stage's loop ended: nothing is left waiting


def test_a_table_of_four_rows_travels_whole_and_every_positions_logits_come_back() -> None:
    """A step whose table has the fourth row (some row asks for every position's logits) reaches each stage with
    it, and the last stage's [rows, width, vocab] comes back whole; a three-row step after it is as before."""
    heights: list[int] = []

    def every(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        heights.append(table.shape[0])
        return x if table.shape[0] > 3 and bool(table[3].any()) else x[:, -1, :]

    engine_side, _ = _ring([_embed, every])

    async def run() -> list[tuple[torch.Tensor, float]]:
        links = DirectLinks(engine_side.pop(), 3)
        links.start()
        ids = torch.arange(6, dtype=torch.long).view(2, 3)
        four = torch.tensor([[0, 1], [0, 0], [3, 3], [1, 0]], dtype=torch.long)
        return [await links.run(ids, four), await links.run(ids, four[:3].contiguous())]

    (whole, _), (last, _) = asyncio.run(run())
    want = (
        torch.arange(6, dtype=torch.float32).view(2, 3)[..., None].expand(2, 3, 4)
        + torch.tensor([0.0, 1.0])[:, None, None]
    )
    assert heights == [4, 3] and torch.equal(whole, want) and torch.equal(last, want[:, -1, :])


class _WatchedStage:
    """A stage as the links watch it: ``links_ended.remote()`` is pending until the stage's process dies (Ray's
    ref then raises; here the event is set and the call raises as Ray's does)."""

    def __init__(self, died: asyncio.Event) -> None:
        self.died = died
        self.links_ended = self

    def remote(self) -> Any:
        return self._ended()

    async def _ended(self) -> str:
        await self.died.wait()
        raise RuntimeError("ActorDiedError: the actor died unexpectedly before finishing this task")


def test_a_stage_that_dies_while_no_step_is_in_flight_fails_the_engine_at_once() -> None:
    """No step runs, so no receive fails: the watch on the stages' ``links_ended`` fails the engine itself (the
    pool then replaces the pipeline, and ``/health`` says 503 meanwhile); closing the links is not a failure."""
    from raycluster_cli.serve.engine import Engine
    from raycluster_cli.serve.scheduler import Limits

    engine_side, _ = _ring([_embed, _double, _logits])

    async def run() -> tuple[BaseException | None, float, Engine]:
        died = asyncio.Event()
        links = DirectLinks(engine_side.pop(), 4)
        engine = Engine([], None, Limits(), frozenset(), links=links)
        links.start([_WatchedStage(died)])
        await asyncio.sleep(0.2)
        assert engine.failure is None
        died.set()
        began = time.monotonic()
        while engine.failure is None and time.monotonic() - began < 5:
            await asyncio.sleep(0.01)
        return engine.failure, time.monotonic() - began, engine

    failure, after_s, _ = asyncio.run(run())
    assert isinstance(failure, LinksDown) and "ActorDiedError" in str(failure), failure
    assert after_s < 1.0


def test_an_engine_closing_its_links_is_not_a_failure() -> None:
    from raycluster_cli.serve.engine import Engine
    from raycluster_cli.serve.scheduler import Limits

    engine_side, _ = _ring([_embed, _double, _logits])

    async def run() -> BaseException | None:
        links = DirectLinks(engine_side.pop(), 4)
        engine = Engine([], None, Limits(), frozenset(), links=links)
        links.start([_WatchedStage(asyncio.Event())])
        await engine.close()  # a drained pipeline retired
        await asyncio.sleep(0.2)
        return engine.failure

    assert asyncio.run(run()) is None


def test_a_relayed_pipeline_s_stage_that_dies_idle_fails_the_engine_too() -> None:
    """Without links (Ray's calls relay the steps) the engine holds ``links_ended`` open on every stage, which a
    stage without links never answers: the call fails when the stage's process ends, and so does the engine."""
    from raycluster_cli.serve.engine import Engine
    from raycluster_cli.serve.scheduler import Limits

    async def run() -> tuple[BaseException | None, BaseException | None]:
        died = asyncio.Event()
        engine = Engine([_WatchedStage(asyncio.Event()), _WatchedStage(died)], None, Limits(), frozenset(), watch=True)
        engine.start()
        await asyncio.sleep(0.2)
        before = engine.failure
        died.set()
        began = time.monotonic()
        while engine.failure is None and time.monotonic() - began < 5:
            await asyncio.sleep(0.01)
        await engine.close()
        return before, engine.failure

    before, failure = asyncio.run(run())
    assert before is None
    assert failure is not None and "ActorDiedError" in str(failure), failure


def test_a_last_stage_that_samples_sends_its_tokens_back_as_ids_and_logits_otherwise() -> None:
    """The last hop's kind follows what the last stage returned: int64 tokens [rows] travel as ``KIND_IDS``, logits
    as ``KIND_LOGITS``, in the order the steps went, and the engine's side counts each kind."""

    def last(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        logits = x[:, -1, :]
        return logits.argmax(-1) if int(table[0, 0]) % 2 == 0 else logits

    engine_side, _ = _ring([_embed, last])

    async def run() -> tuple[list[torch.Tensor], DirectLinks]:
        links = DirectLinks(engine_side.pop(), 3)
        links.start()
        ids = torch.arange(6, dtype=torch.long).view(2, 3)
        steps = [links.run(ids, torch.tensor([[n, n], [0, 0], [3, 3]])) for n in range(4)]
        return [out for out, _ in await asyncio.gather(*steps)], links

    outs, links = asyncio.run(run())
    assert [(o.dtype, tuple(o.shape)) for o in outs] == [(torch.int64, (2,)), (torch.float32, (2, 4))] * 2
    assert links.received == {KIND_IDS: 2, KIND_LOGITS: 2}
