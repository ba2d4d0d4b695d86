"""Draining a node out of a serving pool (serve/draining.py) without Ray: pipelines are in-process stages (the
pool's own test backend), over named nodes that the backend re-splits as the Ray fleet does (the pipeline's other
nodes, free nodes up to the stage count, never a drained one).  Every greedy answer is ``transformers``'
``generate``'s."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from raycluster_cli.placement.pipelines import PipelinePlan
from raycluster_cli.serve import draining
from raycluster_cli.serve.pool import Pipeline, Pool

from .test_serve_pool import PROMPTS, _Backend, _stream, checkpoint, reference  # noqa: F401

STAGES = 2


class _Nodes(_Backend):
    """The pool's test backend over named nodes ("a", "b", ... at 10.0.0.N): a replacement or a growth takes the
    alive nodes no other pipeline uses and no drain excluded, as ``RayFleet`` does."""

    def __init__(self, path: Path, alive: Sequence[str], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.alive = list(alive)
        self.excluded: set[str] = set()

    def plan(self, nodes: Sequence[str]) -> PipelinePlan:
        units = self.cfg.num_units
        cuts = [round(i * units / len(nodes)) for i in range(len(nodes) + 1)]
        ranges = tuple((cuts[i], cuts[i + 1]) for i in range(len(nodes)))
        return PipelinePlan(tuple(nodes), tuple(ip(n) for n in nodes), ranges)

    def exclude(self, nodes: set[str]) -> None:
        self.excluded = set(nodes)

    def usable(self, others: Sequence[Pipeline]) -> list[str]:
        used = {n for p in others for n in p.plan.node_ids}
        return [n for n in self.alive if n not in self.excluded and ip(n) not in self.excluded and n not in used]

    async def replacement(self, dead: Pipeline, others: Sequence[Pipeline]) -> PipelinePlan | None:
        mine = [n for n in dead.plan.node_ids if n not in self.excluded and ip(n) not in self.excluded]
        nodes = mine + [n for n in self.usable(others) if n not in mine][: STAGES - len(mine)]
        return self.plan(nodes) if nodes else None

    async def growth(self, pipelines: Sequence[Pipeline]) -> list[tuple[Pipeline | None, PipelinePlan]]:
        free = self.usable(pipelines)
        if not pipelines:  # none at all: one over the free nodes, as RayFleet's
            return [(None, self.plan(free[:STAGES]))] if free else []
        return [
            (p, self.plan([*p.plan.node_ids, *free[: STAGES - p.plan.stages]]))
            for p in pipelines
            if p.state == "live" and p.plan.stages < STAGES and free
        ]


def ip(node: str) -> str:
    return f"10.0.0.{ord(node) - ord('a') + 1}"


async def _until(check: Any, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)


def test_a_drain_under_load_builds_the_replacement_first_and_no_answer_fails_or_changes(
    checkpoint: Path,  # noqa: F811
    reference: dict[str, tuple[str, list[int]]],  # noqa: F811
) -> None:
    """Node b of pipeline 0 (a, b) is drained while six requests run: pipeline 1 over (a, c) is built, new requests
    go there, pipeline 0's own finish where they are (none moved within the deadline); every answer is generate()'s;
    b is listed as drained and no pipeline uses it."""
    backend = _Nodes(checkpoint, "abc", step_s=0.01, rebuild_s=0.1)

    async def run() -> tuple[list[Any], list[Any], draining.DrainResult, Pool, int]:
        pool = Pool(backend, watch_s=0.05, replace_period_s=3600)
        await pool.add(backend.plan("ab"))
        pool.start()
        first = asyncio.gather(*(_stream(pool, p, backend.tokenizer, stream=i % 2 == 0) for i, p in enumerate(PROMPTS)))
        await _until(lambda: len(pool.pipelines[0].engine.live) == len(PROMPTS))
        running = len(pool.pipelines[0].engine.live)
        drain = asyncio.create_task(draining.drain(pool, ip("b"), deadline_s=60))
        await _until(lambda: len(pool.pipelines) == 2)
        later = await asyncio.gather(*(_stream(pool, p, backend.tokenizer, stream=True) for p in PROMPTS[:3]))
        result = await drain
        answers = await first
        await pool.close()
        return list(answers), list(later), result, pool, running

    answers, later, result, pool, running = asyncio.run(run())
    assert running == len(PROMPTS)
    for prompt, answer in zip(PROMPTS + PROMPTS[:3], answers + later, strict=True):
        assert answer == reference[prompt], prompt
    assert (result.drained, result.replaced_by, result.moved, result.finished) == ([0], [1], 0, len(PROMPTS))
    assert [p.plan.node_ids for p in pool.pipelines] == [("a", "c")]
    assert pool.failovers == 0
    assert [d["node"] for d in pool.status(backend.cfg.layers)["drained"]] == [ip("b")]


def test_streams_still_running_at_the_deadline_move_on_and_continue_from_what_they_sent(
    checkpoint: Path,  # noqa: F811
    reference: dict[str, tuple[str, list[int]]],  # noqa: F811
) -> None:
    """A drain with a deadline shorter than the streams: those left on the drained pipeline move to its
    replacement at the deadline, each continuing after its tokens (no token repeated or lost)."""
    backend = _Nodes(checkpoint, "abc", step_s=0.05)

    async def run() -> tuple[list[Any], draining.DrainResult, Pool]:
        pool = Pool(backend, watch_s=0.05, replace_period_s=3600)
        await pool.add(backend.plan("ab"))
        pool.start()
        first = asyncio.gather(*(_stream(pool, p, backend.tokenizer, stream=i % 2 == 0) for i, p in enumerate(PROMPTS)))
        await _until(lambda: any(len(live.stream.ids) > 1 for live in pool.pipelines[0].engine.live.values()))
        result = await draining.drain(pool, ip("b"), deadline_s=0.1)
        answers = await first
        await pool.close()
        return list(answers), result, pool

    answers, result, pool = asyncio.run(run())
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        assert answer == reference[prompt], prompt
    assert result.moved > 0 and result.moved + result.finished == len(PROMPTS)
    assert pool.failovers == result.moved  # each really moved (a stream left to finish there would not count)
    assert [p.plan.node_ids for p in pool.pipelines] == [("a", "c")]


def test_a_drain_that_would_leave_nothing_serving_is_refused_and_changes_nothing(checkpoint: Path) -> None:  # noqa: F811
    """The only pipeline runs on the only node: draining it is refused; the node is not marked, the pipeline still
    takes requests."""
    backend = _Nodes(checkpoint, "a")

    async def run() -> tuple[Pool, str]:
        pool = Pool(backend, watch_s=0.05, replace_period_s=3600)
        await pool.add(backend.plan("a"))
        with pytest.raises(draining.DrainRefused) as refused:
            await draining.drain(pool, "a", deadline_s=5)
        await pool.close()
        return pool, str(refused.value)

    pool, why = asyncio.run(run())
    assert "without a" in why
    assert pool.drained == {} and backend.excluded == set() and [p.state for p in pool.pipelines] == ["live"]
    assert pool.rebuilding == 0


def test_undrain_lets_the_node_back_and_the_pool_takes_it_in_at_once(
    checkpoint: Path,  # noqa: F811
    reference: dict[str, tuple[str, list[int]]],  # noqa: F811
) -> None:
    """Two nodes, one pipeline: draining b leaves a one-stage pipeline over a; undraining b grows it back over
    (a, b) at once (the periodic look is an hour away), and it answers as generate() does."""
    backend = _Nodes(checkpoint, "ab")

    async def run() -> tuple[list[tuple[str, ...]], dict[str, Any], Pool, Any]:
        pool = Pool(backend, watch_s=0.05, replace_period_s=3600)
        await pool.add(backend.plan("ab"))
        pool.start()
        await draining.drain(pool, "b", deadline_s=5)
        during = [p.plan.node_ids for p in pool.pipelines]
        back = await draining.take_in(pool, ["b"])
        await _until(lambda: len(pool.pipelines) == 1)
        answer = await _stream(pool, PROMPTS[0], backend.tokenizer, stream=True)
        await pool.close()
        return during, back, pool, answer

    during, back, pool, answer = asyncio.run(run())
    assert during == [("a",)]
    assert back["undrained"] == ["b"] and back["grown"] == [2]
    assert [p.plan.node_ids for p in pool.pipelines] == [("a", "b")] and pool.drained == {}
    assert answer == reference[PROMPTS[0]]


def test_a_node_drained_with_no_pipeline_on_it_stays_out_of_growth(checkpoint: Path) -> None:  # noqa: F811
    """Draining a free node marks it: the pool's growth does not build on it until it is let back."""
    backend = _Nodes(checkpoint, "abc")

    async def run() -> tuple[draining.DrainResult, list[Any], list[Any]]:
        pool = Pool(backend, watch_s=0.05, replace_period_s=3600)
        await pool.add(backend.plan("a"))
        result = await draining.drain(pool, "b", deadline_s=5)
        grown = await draining.take_in(pool)
        nodes = [p.plan.node_ids for p in pool.live()]
        await pool.close()
        return result, grown["grown"], nodes

    result, grown, nodes = asyncio.run(run())
    assert result.drained == [] and result.note == "no pipeline ran on it"
    assert grown == [1] and nodes == [("a", "c")]


class _Kept:
    """A drained-marks store in memory (``draining.Marks``: the GCS's on Ray), shared by the pools of one test as the
    GCS is by the ingresses Serve starts one after another."""

    def __init__(self) -> None:
        self.kept: dict[str, float] = {}
        self.saves = 0

    async def save(self, drained: dict[str, float]) -> None:
        self.kept, self.saves = dict(drained), self.saves + 1

    async def load(self) -> dict[str, float]:
        return dict(self.kept)


def test_an_ingress_started_again_keeps_a_drained_node_out_of_its_launchers_plans(
    checkpoint: Path,  # noqa: F811
    reference: dict[str, tuple[str, list[int]]],  # noqa: F811
) -> None:
    """Two replicas planned by the launcher, (a) and (b); b is drained and the ingress's process dies.  The next
    ingress (a new pool over the same store) reads the mark before it builds: it builds (a) only, lists b as drained,
    answers as generate() does, and `undrain` through it lets b back (the mark is gone from the store too)."""
    backend = _Nodes(checkpoint, "ab")
    kept = _Kept()
    launcher = [backend.plan("a"), backend.plan("b")]

    async def first() -> None:
        pool = Pool(backend, watch_s=0.05, replace_period_s=3600, marks=kept)
        for plan in await draining.restore(pool, launcher):
            await pool.add(plan)
        await draining.drain(pool, "b", deadline_s=5)
        await pool.close()

    async def second() -> tuple[list[tuple[str, ...]], dict[str, Any], Any, dict[str, Any], list[str]]:
        backend.excluded = set()  # a new process: nothing excluded until the store is read
        pool = Pool(backend, watch_s=0.05, replace_period_s=3600, marks=kept)
        for plan in await draining.restore(pool, launcher):
            await pool.add(plan)
        built = [p.plan.node_ids for p in pool.pipelines]
        status = pool.status(backend.cfg.layers)
        answer = await _stream(pool, PROMPTS[0], backend.tokenizer, stream=True)
        back = await draining.take_in(pool, ["b"])
        events = [e["event"] for e in pool.events]
        await pool.close()
        return built, status, answer, back, events

    asyncio.run(first())
    assert kept.kept.keys() == {"b"}
    built, status, answer, back, events = asyncio.run(second())
    assert built == [("a",)] and "kept out" in events
    assert [d["node"] for d in status["drained"]] == ["b"]
    assert answer == reference[PROMPTS[0]]
    assert back["undrained"] == ["b"] and kept.kept == {}


def test_an_ingress_whose_every_planned_pipeline_is_drained_builds_over_the_other_nodes(
    checkpoint: Path,  # noqa: F811
) -> None:
    """The launcher planned one pipeline over (a, b) and b is marked drained: the ingress starts on a plan over the
    nodes not drained (a, then c, free), not on none and not on b."""
    backend = _Nodes(checkpoint, "abc")
    kept = _Kept()
    kept.kept = {"b": 1.0}

    async def run() -> list[PipelinePlan]:
        pool = Pool(backend, watch_s=0.05, replace_period_s=3600, marks=kept)
        return await draining.restore(pool, [backend.plan("ab")])

    plans = asyncio.run(run())
    assert [p.node_ids for p in plans] == [("a", "c")]


class _Broken(_Kept):
    async def save(self, drained: dict[str, float]) -> None:
        raise TimeoutError("the GCS did not answer")

    async def load(self) -> dict[str, float]:
        raise TimeoutError("the GCS did not answer")


def test_a_store_that_does_not_answer_neither_stops_a_drain_nor_the_ingress(checkpoint: Path) -> None:  # noqa: F811
    """The drain stands (status says the marks were not kept); an ingress that cannot read them starts on the
    launcher's plans."""
    backend = _Nodes(checkpoint, "abc")

    async def run() -> tuple[list[str], list[tuple[str, ...]]]:
        pool = Pool(backend, watch_s=0.05, replace_period_s=3600, marks=_Broken())
        await pool.add(backend.plan("a"))
        await draining.drain(pool, "b", deadline_s=5)
        plans = await draining.restore(pool, [backend.plan("ab")])
        events = [e["event"] for e in pool.events]
        await pool.close()
        return events, [p.node_ids for p in plans]

    events, plans = asyncio.run(run())
    assert "marks not kept" in events and "marks not read" in events and plans == [("a", "b")]
