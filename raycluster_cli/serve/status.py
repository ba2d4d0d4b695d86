"""The text service's status (``/raycluster/status``): the stages' counters and each pipeline's step anatomy,
asked of the stage actors while the route waits.

Apart from the routes (serve/app.py) because it is the one route that reaches past the engine seam into the
pipelines themselves (their actors and their engines' recent steps), and must stay quick when one of them is frozen.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from raycluster_cli.serve.anatomy import step_anatomy
from raycluster_cli.serve.pool import Pipeline, suspect_after_s
from raycluster_cli.serve.protocol import APIError

COUNTERS_S = 10.0  # how long the status route waits for the stages' counters (behind their queued steps)


def since_of(value: str | None) -> float:
    """``?since=``: a ``now`` this route gave (0: every recent step), or 400 naming it."""
    try:
        return float(value or 0.0)
    except ValueError:
        raise APIError(400, "since must be a number: a `now` this endpoint gave", param="since") from None


async def add_counters(rows: list[dict[str, Any]], pipelines: Sequence[Pipeline], since: float = 0.0) -> None:
    """Each pipeline's stages get their counters (steps, busy_s, cpu_s, pid) from the stage actors, and the
    pipeline its step anatomy (``serve.anatomy``: the engine's and the stages' last steps, those sent at ``since``
    or later), all asked at once; a pipeline whose stages do not answer in time gets ``counters_error`` instead."""

    async def one(actors: list[Any]) -> tuple[list[dict[str, Any]], list[Any]]:
        counters = asyncio.gather(*(a.counters.remote() for a in actors))
        timelines = asyncio.gather(*(a.timeline.remote() for a in actors))
        both = await asyncio.wait_for(asyncio.gather(counters, timelines), COUNTERS_S)
        return list(both[0]), list(both[1])

    async def unless_overdue(actors: list[Any], engine: Any) -> tuple[list[dict[str, Any]], list[Any]]:
        # a pipeline whose steps are overdue (a frozen host answers nothing) is not waited for: status stays quick
        if engine.failure is not None or engine.stalled_s() > suspect_after_s(engine):
            raise TimeoutError(f"not asked: no step came back for {engine.stalled_s():.0f} s")
        return await one(actors)

    stages, engines = [list(p.stages) for p in pipelines], [p.engine for p in pipelines]
    found = await asyncio.gather(
        *(unless_overdue(actors, engine) for actors, engine in zip(stages, engines, strict=True)),
        return_exceptions=True,
    )
    for row, engine, answer in zip(rows, engines, found, strict=True):
        if isinstance(answer, BaseException):
            row["counters_error"] = f"{type(answer).__name__}: {answer}"
            continue
        counters, timelines = answer
        for stage, values in zip(row.get("stages", []), counters, strict=False):
            stage.update(values)
        row["anatomy"] = step_anatomy(list(engine.recent), timelines, list(engine.loop_lag), since)
