"""Taking a node out of a serving pool on purpose (``raycluster drain``), letting it back, and taking in nodes now.

A drain must not fail a request, so it runs in the order a re-split does (``Pool.rebalance``): the pipeline that
replaces one over the node is built first, over the other nodes (the backend's ``replacement`` with the node
excluded: its survivors re-split, free nodes added up to the stage count); only then does the old pipeline stop
taking requests (``draining``), and its streams finish where they are.  Those still running at the deadline move
the way failover moves them: the old engine is failed, and each stream continues on another pipeline from the
tokens it already sent (``Pool.generate``).  A drained node stays out of every later replacement and growth until
``take_in`` lets it back (``raycluster undrain``, or ``up`` starting its host again); ``take_in`` then grows the pool
over the unused nodes at once (a node let back, or one ``up`` added), not at the pool's next periodic look.

The drained marks outlive the ingress: each change is kept in a ``Marks`` store (the cluster's GCS key-value store,
``serve.fleet.GcsMarks``), and an ingress that starts again (Serve replaces one whose process died) reads them
before it builds anything (``restore``), so its launcher's plans never put a stage back on a drained node.

Pure asyncio over the pool, as the pool is: the Ray side is the backend's and the store's, and the ingress's handle
methods call these (serve/app.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from raycluster_cli.serve.engine import EngineDown

if TYPE_CHECKING:
    from raycluster_cli.placement.pipelines import PipelinePlan
    from raycluster_cli.serve.pool import Pipeline, Pool

RETIRE_S = 10.0  # after the deadline: how long the moved pipelines get to leave the pool
POLL_S = 0.1


class Marks(Protocol):
    """Where the drained marks (node id or IP -> when it was drained) are kept beyond the ingress's life."""

    async def save(self, drained: dict[str, float]) -> None: ...

    async def load(self) -> dict[str, float]: ...


class DrainRefused(RuntimeError):
    """A drain that would leave the service without a pipeline (no other node can hold the model)."""


@dataclass
class DrainResult:
    """What one drain did: the node, the pipelines it took off the node and those that replaced them, the streams
    that finished where they were and those moved at the deadline, and how long it took."""

    node: str
    drained: list[int] = field(default_factory=list)
    replaced_by: list[int] = field(default_factory=list)
    finished: int = 0
    moved: int = 0
    seconds: float = 0.0
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def uses(pipeline: Pipeline, node: str) -> bool:
    """Does the pipeline run a stage on ``node`` (a Ray node id, or a node's IP: every node at that address)."""
    return node in pipeline.plan.node_ids or node in pipeline.plan.ips


def over(pool: Pool, node: str) -> list[Pipeline]:
    return [p for p in pool.pipelines if p.state != "dead" and p.engine.failure is None and uses(p, node)]


async def drain(pool: Pool, node: str, deadline_s: float) -> DrainResult:
    """Take ``node`` out of the pool: replacements built first, then the node's pipelines drained, their streams
    given ``deadline_s`` to finish, the rest moved.  ``DrainRefused`` when nothing else could serve."""
    if deadline_s < 0:
        raise ValueError(f"deadline {deadline_s} is negative")
    started = time.monotonic()
    result = DrainResult(node)
    pool.rebuilding += 1  # no growth or re-split starts meanwhile: they could build on the node again
    try:
        pool.drained[node] = time.time()
        await _exclude(pool)
        olds = over(pool, node)
        if not olds:
            result.note = "no pipeline ran on it"
            return result
        await _replace(pool, olds, result)
        before = {p.index: len(p.engine.live) for p in olds}
        for old in olds:
            old.state = "draining"  # no new request reaches it; look() retires it once its own are done
        pool._note("draining", None, f"node {node}: pipeline(s) {', '.join(str(p.index) for p in olds)}")
        result.drained = [p.index for p in olds]
        result.moved = await _finish(pool, olds, started + deadline_s, node)
        result.finished = max(0, sum(before.values()) - result.moved)
        return result
    except BaseException:
        if not result.drained:  # refused or failed before any pipeline left the node: the node is not drained
            pool.drained.pop(node, None)
            await _exclude(pool)
        raise
    finally:
        pool.rebuilding -= 1
        result.seconds = round(time.monotonic() - started, 3)


async def _replace(pool: Pool, olds: list[Pipeline], result: DrainResult) -> None:
    """A pipeline without the node for each of ``olds`` (where the other nodes can hold one), built before any of
    them stops taking requests; refused when none could be built and no other pipeline serves."""
    for old in olds:
        others = [p for p in pool.pipelines if p is not old]
        plan = await pool.backend.replacement(old, others)
        if plan is None or any(uses_any(plan, set(pool.drained))):
            continue
        new = await pool.add(plan)
        result.replaced_by.append(new.index)
        pool._note("replaced", old, f"by pipeline {new.index} over {plan.stages} stage(s) without the drained node")
    if not result.replaced_by and not [p for p in pool.live() if p not in olds]:
        raise DrainRefused(f"no other node can hold the model without {result.node}: the service would stop")


def uses_any(plan: Any, nodes: set[str]) -> list[str]:
    """The nodes of ``nodes`` a plan runs a stage on."""
    return [n for n in nodes if n in plan.node_ids or n in plan.ips]


async def _finish(pool: Pool, olds: list[Pipeline], deadline: float, node: str) -> int:
    """Wait for the drained pipelines to empty (the pool's watch retires them), until ``deadline``; then move what
    is left (its engine failed: its streams continue elsewhere from the tokens they sent).  The streams moved."""
    while any(p in pool.pipelines for p in olds) and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    moved = 0
    for old in olds:
        if old in pool.pipelines and old.engine.failure is None:
            moved += len(old.engine.live)
            old.engine.fail(EngineDown(f"node {node} drained: its deadline passed"))
    retire_by = time.monotonic() + RETIRE_S
    while any(p in pool.pipelines for p in olds) and time.monotonic() < retire_by:
        await asyncio.sleep(POLL_S)
    return moved


async def take_in(pool: Pool, nodes: Sequence[str] = (), wait_s: float = 600.0) -> dict[str, Any]:
    """Let ``nodes`` back (drained ones, or the nodes of hosts ``up`` started again), then grow the pool now over
    the alive nodes no pipeline uses (``Pool.grow``), not at its next periodic look; waits for a re-plan under way
    to end first, up to ``wait_s``.  Which nodes were drained, and the pipelines it added."""
    was = [n for n in nodes if pool.drained.pop(n, None) is not None]
    await _exclude(pool)
    until = time.monotonic() + wait_s
    while pool.rebuilding and time.monotonic() < until:
        await asyncio.sleep(POLL_S)
    if pool.rebuilding:
        raise TimeoutError(f"a re-plan was still under way after {wait_s:.0f} s")
    known = {p.index for p in pool.pipelines}
    pool.rebuilding += 1
    try:
        await pool.grow()
    finally:
        pool.rebuilding -= 1
    return {"undrained": was, "grown": sorted(p.index for p in pool.pipelines if p.index not in known)}


async def _exclude(pool: Pool) -> None:
    """The pool's drained marks handed to its backend (no stage goes there) and kept in its store, if it has one."""
    pool.backend.exclude(set(pool.drained))
    if pool.marks is not None:
        try:
            await pool.marks.save(dict(pool.drained))
        except Exception as exc:  # the drain itself stands; an ingress started again would not know of it
            pool._note("marks not kept", None, f"the drained marks were not saved ({type(exc).__name__}: {exc})")


async def restore(pool: Pool, plans: Sequence[PipelinePlan]) -> list[PipelinePlan]:
    """The marks an earlier ingress kept, taken back before anything is built; ``plans`` (the launcher's) less those
    that would put a stage on a drained node.  When that leaves none, the plan the backend makes over the nodes that
    are not drained (its growth over an empty pool); the pool's periodic look takes in the other free nodes."""
    if pool.marks is None:
        return list(plans)
    try:
        pool.drained = dict(await pool.marks.load())
    except Exception as exc:  # the store did not answer: start with the launcher's plans rather than not at all
        pool._note("marks not read", None, f"the drained marks could not be read ({type(exc).__name__}: {exc})")
        return list(plans)
    if not pool.drained:
        return list(plans)
    pool.backend.exclude(set(pool.drained))
    kept = []
    for plan in plans:
        if on := uses_any(plan, set(pool.drained)):
            pool._note("kept out", None, f"a planned pipeline over drained node(s) {', '.join(on)} not built")
        else:
            kept.append(plan)
    if not kept:
        kept = [plan for _, plan in await pool.backend.growth([])]
    return kept
