"""Several pipelines behind one ingress: least-outstanding-work routing, failover, re-placement.

Why one ingress that owns every pipeline's engine and routes itself, rather than one Serve replica
per pipeline behind a custom router: a stream that already sent tokens must continue on another
pipeline *inside the same HTTP response*, and only the process that holds the response can do that;
Serve's router picks a replica per request and cannot move a response between replicas.  The
router also needs each pipeline's load in tokens (prompt tokens still to prefill plus tokens still
to generate), which the engine knows exactly at the moment of the choice, with no stale report in
between.  The ingress is a light process (tokenizer, scheduler, sampling); the heavy work is in the
stage actors on the nodes.

Pure asyncio (no Ray): what starts and stops pipelines on nodes is a ``Backend`` (``serve.fleet``
on Ray; in-process stages in the unit tests).  A pipeline whose stage died is taken out at once;
its requests continue on the others (``generate``), its surviving nodes are re-planned into a new
pipeline in the background, and a periodic look takes in nodes that came back.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from raycluster_cli.placement.pipelines import PipelinePlan
from raycluster_cli.serve.engine import Engine, EngineDown, Output, QueueFull, RequestFailed, Resume
from raycluster_cli.serve.metrics import Recorder, RequestTimer, pipeline_gauges
from raycluster_cli.serve.text import Sampling

if TYPE_CHECKING:
    from raycluster_cli.serve.draining import Marks

log = logging.getLogger("raycluster.serve")
T = TypeVar("T")
MAX_FAILOVERS = 3  # a request moved this often is failed: something else is wrong
GAUGES_S = 1.0  # how often the pipelines' gauges (running, waiting, KV slots) are set
# The liveness look.  A host that freezes or is cut off closes no connection, so its pipeline's steps just stop
# coming back; the stall deadline alone (``stall_s``, 30 s) held every stream on it that long (docs/PERFORMANCE.md
# S7).  Steps overdue by SUSPECT_FACTOR x the slowest recent round trip (at least ``suspect_floor_s``) make the
# pool ping the pipeline's stages; one that does not answer within ``answer_timeout_s`` fails the pipeline then.
# A slow step (a long prompt's chunk, a loaded host) is not a lost one: its stages answer, and only the stall
# deadline ends it.
SUSPECT_FACTOR = 10.0
SUSPECT_FLOOR_S = 2.0
ANSWER_TIMEOUT_S = 5.0


@dataclass
class Pipeline:
    """One replica: its plan, its stage actors (handles), its engine, and where it stands."""

    index: int
    plan: PipelinePlan
    engine: Engine
    stages: list[Any]
    state: str = "live"  # live: takes requests; draining: finishes its own, then stops; dead: stage lost
    served: int = 0
    started_at: float = field(default_factory=time.monotonic)


class Backend(Protocol):
    """What the pool needs from the cluster."""

    async def build(self, plan: PipelinePlan, index: int) -> tuple[Engine, list[Any]]:
        """Start the plan's stages and an engine over them; return once a probe generated through all."""
        ...

    async def stop(self, pipeline: Pipeline) -> None: ...

    async def replacement(self, dead: Pipeline, others: Sequence[Pipeline]) -> PipelinePlan | None:
        """The plan that takes a dead pipeline's place (its surviving nodes, free ones), None if none."""
        ...

    async def growth(self, pipelines: Sequence[Pipeline]) -> list[tuple[Pipeline | None, PipelinePlan]]:
        """(pipeline to replace or None, new plan) for nodes that are alive and unused."""
        ...

    async def rebalance(self, pipeline: Pipeline) -> PipelinePlan | None:
        """A better split of ``pipeline`` over its own nodes from what its stages measured since the last look
        (``placement.resplit``), None to keep it."""
        ...

    async def unanswered(self, pipeline: Pipeline, timeout_s: float) -> str | None:
        """Which of the pipeline's stages did not answer a ping within ``timeout_s`` (or failed it), and where;
        None when every one answered."""
        ...

    def exclude(self, nodes: set[str]) -> None:
        """The nodes (ids or IPs) drained by the operator (serve/draining.py): no replacement or growth uses them."""
        ...


def suspect_after_s(engine: Engine, floor_s: float = SUSPECT_FLOOR_S) -> float:
    """How long an engine's steps may be overdue before its stages are asked whether they live."""
    return max(floor_s, SUSPECT_FACTOR * engine.slowest_step_s())


def least_loaded(candidates: Sequence[T], load: Callable[[T], tuple[float, ...]]) -> T | None:
    """The candidate with the least load (ties: the earliest), None if there is none."""
    return min(candidates, key=load, default=None)


def pipeline_load(pipeline: Pipeline) -> tuple[float, ...]:
    """Outstanding tokens, then requests on it, then its age (an older pipeline first)."""
    return (pipeline.engine.outstanding, len(pipeline.engine.live), pipeline.index)


class Pool:
    """The pipelines, the routing of requests over them, and the watch that replaces the lost ones."""

    def __init__(
        self,
        backend: Backend,
        *,
        failover_wait_s: float = 90.0,
        replace_period_s: float = 30.0,
        stall_s: float = 30.0,
        watch_s: float = 0.5,
        rebalance_period_s: float = 0.0,
        suspect_floor_s: float = SUSPECT_FLOOR_S,
        answer_timeout_s: float = ANSWER_TIMEOUT_S,
        recorder: Recorder | None = None,
        model: str = "",
        marks: Marks | None = None,
    ) -> None:
        self.backend = backend
        self.marks = marks  # where the drained marks are kept beyond this process (serve/draining.py); None: nowhere
        self.recorder, self.model = recorder, model  # the service's metrics (serve.metrics); None: none
        self.suspect_floor_s = suspect_floor_s  # steps overdue this long (or SUSPECT_FACTOR x the slowest): ask
        self.answer_timeout_s = answer_timeout_s  # a stage that does not answer within this is taken as lost
        self.failover_wait_s = failover_wait_s
        self.replace_period_s = replace_period_s
        self.rebalance_period_s = rebalance_period_s  # 0: never re-split a pipeline from its measurements
        self.stall_s = stall_s
        self.watch_s = watch_s
        self.pipelines: list[Pipeline] = []
        self.failovers = 0
        self.events: list[dict[str, Any]] = []  # failures, replacements, growth: what status shows
        self.rebuilding = 0
        self.lost_at: float | None = None  # when the last live pipeline went (None: one is live)
        self.drained: dict[str, float] = {}  # node id or IP -> when the operator drained it (serve/draining.py)
        self._numbers = itertools.count()
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._watch_task: asyncio.Task[None] | None = None
        self._asked: dict[int, float] = {}  # pipeline index -> when its stages' last ask ended
        self._asking: set[int] = set()  # the pipelines whose stages are being asked now
        self._gauged: set[int] = set()  # the pipelines whose gauges were set (a removed one's go to 0 once)

    # -- pipelines ---------------------------------------------------------------------------------

    async def add(self, plan: PipelinePlan) -> Pipeline:
        index = next(self._numbers)
        engine, stages = await self.backend.build(plan, index)
        pipeline = Pipeline(index, plan, engine, stages)
        self.pipelines.append(pipeline)
        self.lost_at = None
        self._changed.set()
        return pipeline

    def live(self) -> list[Pipeline]:
        return [p for p in self.pipelines if p.state == "live" and p.engine.failure is None]

    def choose(self) -> Pipeline | None:
        return least_loaded(self.live(), pipeline_load)

    def _note(self, event: str, pipeline: Pipeline | None, detail: str = "") -> None:
        entry = {"at": time.time(), "event": event, "pipeline": pipeline.index if pipeline else None}
        self.events = [*self.events[-49:], entry | ({"detail": detail} if detail else {})]
        log.warning("serve: %s pipeline %s %s", event, entry["pipeline"], detail)

    # -- requests ------------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        sampling: Sampling,
        stop: list[str] | None = None,
        *,
        stream: bool,
        choice: int = 0,
    ) -> AsyncGenerator[Output, None]:
        """One request's outputs from the least loaded pipeline; when that pipeline dies mid-request the
        request moves to another: a stream continues after the tokens it already has (their KV cache
        rebuilt there, no piece sent twice); a whole answer, of which nothing was sent, is run again
        (so a seeded one stays reproducible).  A request that finds no live pipeline while one is being
        rebuilt (the only replica lost a node) waits for it like a moved one.  Raises ``EngineDown``
        (503) only when no pipeline serves or is coming back, or none came back within
        ``failover_wait_s``.  ``choice``: which of a request's ``n`` generations this is (its metrics count
        the request and its prompt once, with the first)."""
        timer = RequestTimer(self.recorder, self.model, len(prompt), counted=choice == 0)
        try:
            async for out in self._generate(prompt, max_tokens, sampling, stop, stream, timer):
                yield out
        except (QueueFull, ValueError):  # 503 full, 400 too long: refused before it started
            timer.end("refused")
            raise
        except (EngineDown, RequestFailed):  # RequestFailed: its own input, never moved to another pipeline
            timer.end("error")
            raise
        finally:
            timer.end("abort")  # the client left (or the request was refused): no-op once it ended

    async def _generate(
        self,
        prompt: list[int],
        max_tokens: int,
        sampling: Sampling,
        stop: list[str] | None,
        stream: bool,
        timer: RequestTimer,
    ) -> AsyncGenerator[Output, None]:
        tokens: tuple[int, ...] = ()
        released = 0
        for attempt in range(MAX_FAILOVERS + 1):
            pipeline = self.choose() if attempt == 0 else await self._wait_live()
            if pipeline is None and self._coming_back():  # none live, one on its way back: wait for it, not 503
                pipeline = await self._wait_live()
            if pipeline is None:
                raise EngineDown("no pipeline is serving" + (" (failover waited)" if attempt else ""))
            resume = Resume(tokens, released) if stream and tokens else None
            outputs = pipeline.engine.generate(
                prompt, max_tokens, sampling, stop, resume=resume, queue_limit=attempt == 0
            )
            held: list[Output] = []
            try:
                async for out in outputs:
                    timer.output(len(out.token_ids))
                    if stream:
                        tokens, released = out.token_ids, released + len(out.text)
                        yield out
                    else:
                        held.append(out)
                    if out.finish_reason is not None:
                        pipeline.served += 1
                        timer.end(out.finish_reason)
                        for whole in held:
                            yield whole
                        return
            except EngineDown as exc:
                self.failovers += 1
                if self.recorder is not None:
                    self.recorder.record("raycluster_serve_failovers", 1, {"model": self.model})
                self._note("failover", pipeline, f"{len(tokens)} token(s) sent: {exc}")
            finally:
                await outputs.aclose()
        raise EngineDown(f"the request failed on {MAX_FAILOVERS + 1} pipelines")

    def _coming_back(self) -> bool:
        """A pipeline is on its way back: a re-plan is under way, or a live one failed that the watch has not taken
        out yet (its next look, within ``watch_s``, starts its replacement)."""
        return bool(self.rebuilding) or any(p.state == "live" and p.engine.failure is not None for p in self.pipelines)

    async def _wait_live(self) -> Pipeline | None:
        deadline = time.monotonic() + self.failover_wait_s
        while (pipeline := self.choose()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
        return pipeline

    # -- the watch -----------------------------------------------------------------------------------

    def start(self) -> None:
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    async def close(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
        for pipeline in self.pipelines:
            await pipeline.engine.close()

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self) -> None:
        last_growth = last_balance = last_gauges = time.monotonic()
        while True:
            await asyncio.sleep(self.watch_s)
            try:
                self.look()
                if self.recorder is not None and time.monotonic() - last_gauges >= GAUGES_S:
                    last_gauges = time.monotonic()
                    self.gauges()
                if time.monotonic() - last_growth >= self.replace_period_s and not self.rebuilding:
                    last_growth = time.monotonic()
                    self.rebuilding += 1  # one re-plan at a time; the watch goes on meanwhile
                    self._spawn(self._once(self.grow, "growth"))
                if (
                    self.rebalance_period_s > 0
                    and time.monotonic() - last_balance >= self.rebalance_period_s
                    and not self.rebuilding
                ):
                    last_balance = time.monotonic()
                    self.rebuilding += 1
                    self._spawn(self._once(self.rebalance, "rebalance"))
            except Exception:  # the watch must outlive any one bad look
                log.exception("serve: the pipelines' watch failed once")

    def look(self) -> None:
        """Fail wedged pipelines, replace dead ones (in the background), retire drained ones."""
        for pipeline in list(self.pipelines):
            engine = pipeline.engine
            if pipeline.state != "dead" and engine.failure is None and engine.stalled_s() > self.stall_s:
                engine.fail(TimeoutError(f"no step came back for {engine.stalled_s():.0f} s"))
            elif pipeline.state != "dead" and engine.failure is None and self._overdue(pipeline):
                self._asking.add(pipeline.index)  # one ask at a time per pipeline (``_ask`` ends it)
                self._spawn(self._ask(pipeline))
            if pipeline.state == "draining" and engine.failure is not None:
                pipeline.state = "dead"  # already superseded: its requests move, nothing replaces it
                self.pipelines.remove(pipeline)
                self._spawn(self._retire(pipeline))
            elif pipeline.state != "dead" and engine.failure is not None:
                pipeline.state = "dead"
                self._note("failed", pipeline, str(engine.failure))
                self.rebuilding += 1
                self._spawn(self._replace(pipeline))
            elif pipeline.state == "draining" and not engine.live:
                self.pipelines.remove(pipeline)
                self._spawn(self._retire(pipeline))
        if not self.live() and self.lost_at is None:
            self.lost_at = time.monotonic()

    def gauges(self) -> None:
        """Set the pipelines' gauges (serve.metrics), and those of pipelines gone since the last time to 0."""
        if self.recorder is None:
            return
        now = {p.index for p in self.pipelines}
        pipeline_gauges(self.recorder, self.model, list(self.pipelines), sorted(self._gauged - now), len(self.live()))
        self._gauged = now

    def _overdue(self, pipeline: Pipeline) -> bool:
        """Steps overdue (``SUSPECT_FACTOR`` x the slowest recent round trip, at least ``suspect_floor_s``) and its
        stages not asked within as long."""
        engine = pipeline.engine
        suspect_s = suspect_after_s(engine, self.suspect_floor_s)
        asked = self._asked.get(pipeline.index)
        if pipeline.index in self._asking or engine.stalled_s() <= suspect_s:
            return False
        return asked is None or time.monotonic() - asked > suspect_s

    async def _ask(self, pipeline: Pipeline) -> None:
        """Ping the stages of a pipeline whose steps are overdue; one that does not answer (its host frozen, its
        link cut: no connection closes, so nothing else fails) fails the pipeline now rather than at the stall
        deadline, unless a step came back meanwhile."""
        engine, steps = pipeline.engine, pipeline.engine.steps_done
        try:
            why = await asyncio.wait_for(
                self.backend.unanswered(pipeline, self.answer_timeout_s), self.answer_timeout_s + 5.0
            )
        except Exception as exc:  # the look itself failed: the stall deadline still stands
            log.warning("serve: pinging pipeline %s failed: %s: %s", pipeline.index, type(exc).__name__, exc)
            return
        finally:
            self._asking.discard(pipeline.index)
            self._asked[pipeline.index] = time.monotonic()  # the next ask waits as long again after this one
        if why is not None and engine.failure is None and engine.steps_done == steps and engine.stalled_s() > 0:
            engine.fail(TimeoutError(f"no step came back for {engine.stalled_s():.0f} s and {why}"))

    async def _retire(self, pipeline: Pipeline) -> None:
        await pipeline.engine.close()
        await self.backend.stop(pipeline)
        self._note("retired", pipeline)

    async def _replace(self, dead: Pipeline) -> None:
        try:
            with contextlib.suppress(Exception):
                await self.backend.stop(dead)
            if dead in self.pipelines:
                self.pipelines.remove(dead)
            plan = await self.backend.replacement(dead, list(self.pipelines))
            if plan is None:
                self._note("not replaced", dead, "no node left for it")
                return
            new = await self.add(plan)
            self._note("replaced", dead, f"by pipeline {new.index} over {len(plan.ranges)} stage(s)")
        except Exception as exc:
            self._note("replacement failed", dead, f"{type(exc).__name__}: {exc}")
        finally:
            self.rebuilding -= 1

    async def _once(self, work: Callable[[], Awaitable[None]], what: str) -> None:
        """One background re-plan (``rebuilding`` was raised for it); its failure noted, never raised."""
        try:
            await work()
        except Exception as exc:
            self._note(f"{what} failed", None, f"{type(exc).__name__}: {exc}")
        finally:
            self.rebuilding -= 1

    async def grow(self) -> None:
        """Take in alive nodes no pipeline uses: a degraded pipeline is rebuilt with them (the new one
        first, then the old one drains), or they form new replicas."""
        for old, plan in await self.backend.growth(list(self.pipelines)):
            new = await self.add(plan)
            if old is not None and old in self.pipelines:
                old.state = "draining"
            self._note("grown", new, f"{len(plan.ranges)} stage(s)" + (f", replaces {old.index}" if old else ""))

    async def rebalance(self) -> None:
        """Re-split the live pipelines whose stages measured a better split under load: the new pipeline over
        the same nodes is built first, then the old one drains (its requests finish there, new ones go to the
        new one), so no request fails or waits for the rebuild."""
        for old in self.live():
            plan = await self.backend.rebalance(old)
            if plan is None or old not in self.live():
                continue
            new = await self.add(plan)
            if old in self.pipelines:
                old.state = "draining"
            self._note("rebalanced", new, f"replaces {old.index}: {plan.why}")

    def health(self, grace_s: float) -> str | None:
        """Why the service cannot answer (None: it can): no live pipeline and none coming back soon."""
        if self.live() or self.lost_at is None:
            return None
        down = time.monotonic() - self.lost_at
        if self.rebuilding and down < grace_s:
            return None
        return f"no pipeline has served for {down:.0f} s"

    def status(self, num_blocks: int) -> dict[str, Any]:
        return {
            "replicas": len(self.live()),
            "failovers": self.failovers,
            "rebuilding": self.rebuilding,
            "drained": [{"node": node, "since": since} for node, since in self.drained.items()],
            "pipelines": [
                {
                    "index": p.index,
                    "state": p.state,
                    "served": p.served,
                    "outstanding_tokens": p.engine.outstanding,
                    "requests": len(p.engine.live),
                    "waiting": p.engine.waiting,  # queued for a slot
                    "running": len(p.engine.scheduler.running),  # holding a slot
                    "slots": p.engine.scheduler.limits.slots,  # rows at once: --slots for each step in flight
                    **p.engine.scheduler.kv_status(),  # the KV budget in tokens, those held, preemptions
                    "links": p.engine.transport,  # direct links between the stages, or Ray's calls
                    # steps back as token ids (sampled on the last stage) or as logits (a row needed them here)
                    "steps_back": dict(p.engine.shipped),
                    **({"links_note": p.engine.links_note} if p.engine.links_note else {}),
                    **_with_infos(p.plan.to_json(num_blocks), p.engine.stage_infos),
                }
                for p in self.pipelines
            ],
            "events": self.events[-20:],
        }


def _with_infos(plan: dict[str, Any], infos: list[dict[str, Any]]) -> dict[str, Any]:
    """The plan's stage rows with what each stage reported when it loaded: its device ("cpu", "cuda"), and on a
    CPU the form each row count's products take (``models.matmuls``) and the packed weights' MB."""
    for row, info in zip(plan["stages"], infos, strict=False):
        row.update({k: info[k] for k in ("device", "matmuls") if k in info})
    return plan
