"""Images to replicas of unequal speed, bound late: each image goes to a replica only when that replica can start it.

Used by `bench`'s counted runs on a diffusers checkpoint and by the image service (serve/image_app.py), so the
benchmark measures the router the service runs.  The replicas are ``diffusion.workers.Replica`` (a whole
pipeline on one node, or its parts as stages) or ``unet_workers.CutReplica``; each has ``depth`` lanes (one for a
whole pipeline, as its actor makes one image at a time; a staged one keeps every stage busy).

**Late binding.**  Images wait here, not in the replicas' actor queues, and are handed out one lane at a time.  With a
backlog every free lane takes the next image at once, so each replica makes images at the pace it really has, whatever
its calibration said (a replica that is 4× faster comes back 4× as often); what the measured speeds decide is the
tail: an image goes to a free lane only if it would finish there first, counting what each busy lane still has
left (``_plan``: earliest finish over every lane, the waiting images in order), so the last images do not land on a
slow node while a fast one is about to free up.  A lane's image that has run longer than its replica's seconds per
image makes that replica's estimate at least that long (a slowed node stops attracting images while it is slow); a
check runs again while a lane idles beside waiting images.  The earlier rule bound every image at its arrival, from
the estimates of that moment: a burst of 21 images on a calibration taken under another load went 12 / 4 / 5 with
busy times 0.85 apart (docs/PERFORMANCE.md, I6).

One request's ``n`` images are ``n`` separate images (seed, seed + 1, …), routed like any others.  An image's
**work** is its steps × pixels over the calibration image's (``work``): the client chooses it, so every time and
bound here is in work, not images.  Seconds per unit of work start at the calibration's and follow each served
image (its time on the lane over its work, folded in with weight ``LEARN``); an image's deadline is its work times
that; the images held (``max_waiting``) are counted in work, so 64 small images or 4 of 16× the work fill it alike.  ``policy="equal"`` is the reference a speed-weighted run is compared with: image k waits for
replica k mod n, as a round robin does.

A replica whose actor died is taken out and its image made again on another one: the image depends only on its
request, so a moved image is the same image.  An image past its deadline is not proof of a lost node (an expensive
image on a loaded node runs long): the replica is pinged first (``ping`` answers on a thread of its own beside the
image, as the text pool's stages do), and one that answers within ``PING_S`` is busy, so the image goes on waiting
there (and is pinged again each deadline); only a replica that does not answer (a frozen or cut-off node) is taken
out.  A replica taken out is re-grown in the background (``regrow``: the service places and times a new one on the
nodes alive then).  With no replica left and none on its way back every waiting image fails with ``NoReplica``
(the service answers 503 and ``check_health`` fails, so Ray Serve rebuilds the ingress).  Pure asyncio over
awaitable object refs (no Ray call), so the routing is tested with fakes as well as on Ray.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ray.exceptions import ObjectLostError, RayActorError

from raycluster_cli.diffusion.parts import ImageRequest

LOST = (RayActorError, ObjectLostError, TimeoutError)  # the replica is gone (or frozen): move the image
PING_S = 10.0  # a replica whose image is overdue has this long to answer a ping before it counts as lost
MAX_ATTEMPTS = 3  # an image moved this often fails: something other than one node is wrong
LEARN = 0.2  # the weight of each served image's time in a replica's seconds per image
RECHECK_S = (0.005, 0.5)  # bounds of the wait before looking again while a lane idles beside waiting images


class ImagesWaitingFull(Exception):
    """More images waiting than the service takes: a 503 with Retry-After."""


class NoReplica(Exception):
    """No replica is serving: a 503 with Retry-After."""


class ReplicaLike(Protocol):
    actors: list[Any]

    def submit(self, request: ImageRequest) -> Awaitable[Any]: ...

    def kill(self) -> None: ...


def work(request: ImageRequest, base: tuple[int, int] | None) -> float:
    """An image's cost in calibration images: its steps × pixels over ``base`` (the calibration's steps and
    pixels), times its ``n``; 1 per image without a base (every image is the calibration's, as in ``bench``)."""
    if base is None:
        return float(request.n)
    steps, pixels = base
    return request.n * (request.steps * request.height * request.width) / (steps * pixels)


def lanes_of(replica: Any) -> int:
    """Images a replica runs at once: one for a whole pipeline (its actor makes one at a time), else its own
    ``depth`` or one per stage."""
    if getattr(replica, "whole", False):
        return 1
    return int(getattr(replica, "depth", len(replica.actors)))


@dataclass
class Slot:
    """One replica as the router sees it: its measured speed, the images on its lanes, what it made."""

    index: int
    replica: ReplicaLike
    s_per_image: float
    holders: list[dict[str, Any]]  # [{"node_id", "node_ip", "parts"}]
    lanes: int = 1
    started: list[tuple[float, float]] = field(default_factory=list)  # (monotonic start, work) per busy lane
    served: int = 0
    state: str = "live"  # live | lost
    error: str = ""
    lost_at: float | None = None
    calibrated_s: float = 0.0  # the calibration's seconds per image (``s_per_image`` then follows the traffic)
    limits: dict[str, Any] = field(default_factory=dict)  # what the service measured of it (memory per pixel …)

    def __post_init__(self) -> None:
        self.calibrated_s = self.calibrated_s or self.s_per_image

    @property
    def held(self) -> int:
        return len(self.started)

    @property
    def held_work(self) -> float:
        return sum(w for _, w in self.started)

    def learn(self, seconds: float, work: float = 1.0) -> None:
        """Fold one served image's time on its lane, per unit of its work, into ``s_per_image``."""
        if seconds > 0 and work > 0:
            self.s_per_image = (1 - LEARN) * self.s_per_image + LEARN * seconds / work

    def cost(self, now: float) -> float:
        """Seconds a unit of work takes here: the estimate, or longer if an image on a lane has already run longer
        than its work at that pace."""
        return max([self.s_per_image, *((now - t) / w for t, w in self.started if w > 0)])

    def to_json(self) -> dict[str, Any]:
        row = {
            "index": self.index, "state": self.state, "s_per_image": self.s_per_image, "held": self.held,
            "served": self.served, "stages": self.holders, "calibrated_s_per_image": self.calibrated_s,
            "lanes": self.lanes,
        }  # fmt: skip
        return row | ({"error": self.error} if self.error else {}) | self.limits


@dataclass
class _Waiter:
    future: asyncio.Future[tuple[Slot, float]]
    work: float = 1.0
    slot: Slot | None = None  # the equal policy's replica, fixed on arrival


@dataclass
class ImagePool:
    slots: list[Slot]
    max_waiting: float = 64  # work held (on lanes and waiting, in calibration images) before new requests get 503
    # seconds an image may take on its lane before its replica is pinged, given the seconds it should take there
    deadline: Callable[[float], float] = lambda s: max(60.0, 20 * s)
    policy: str = "weighted"  # or "equal": the round robin a weighted run is compared with
    events: list[dict[str, Any]] = field(default_factory=list)
    observe: Callable[[Slot, float], None] | None = None  # called with each served image's slot and lane seconds
    base: tuple[int, int] | None = None  # the calibration image's (steps, pixels): what one unit of work is
    regrow: Callable[[Slot], Awaitable[Slot | None]] | None = None  # a new replica in place of a lost one
    ping_s: float = PING_S
    regrowing: int = 0
    _waiting: deque[_Waiter] = field(default_factory=deque, init=False, repr=False)
    _turn: int = field(default=0, init=False, repr=False)
    _timer: asyncio.TimerHandle | None = field(default=None, init=False, repr=False)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.policy not in ("weighted", "equal"):
            raise ValueError(f"routing policy {self.policy!r}: use 'weighted' or 'equal'")

    def live(self) -> list[Slot]:
        return [s for s in self.slots if s.state == "live"]

    @property
    def held(self) -> float:
        """Work on the replicas' lanes and waiting for one."""
        return sum(s.held_work for s in self.slots) + sum(w.work for w in self._waiting if not w.future.done())

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiting if not w.future.done())

    async def images(self, requests: Sequence[ImageRequest]) -> list[Any]:
        """Every request's image (each a (1, H, W, 3) float array in [0, 1]), in request order; the whole call is
        refused up front when it would take the work held past ``max_waiting``."""
        held, asked = self.held, sum(work(r, self.base) for r in requests)
        if held + asked > self.max_waiting and held > 0:
            raise ImagesWaitingFull(
                f"{held:.1f} image(s) of work in progress and {asked:.1f} asked, at most {self.max_waiting:g} held"
            )
        if not self.live():
            raise NoReplica("no replica is serving" + (" (one is being re-grown)" if self.regrowing else ""))
        return list(await asyncio.gather(*(self.image(r) for r in requests)))

    async def image(self, request: ImageRequest) -> Any:
        cost = work(request, self.base)
        for _ in range(MAX_ATTEMPTS):
            slot, began = await self._lane(cost)
            try:
                out = await self._made(slot, request, cost)
            except LOST as exc:
                self.lose(slot, exc)
                continue
            finally:
                self._release(slot, began, cost)
            seconds = time.monotonic() - began
            slot.served += 1
            slot.learn(seconds, cost)
            if self.observe is not None:
                self.observe(slot, seconds)
            return out
        raise NoReplica(f"the image failed on {MAX_ATTEMPTS} replicas")

    async def _made(self, slot: Slot, request: ImageRequest, cost: float) -> Any:
        """The image from ``slot``: each time it runs past its deadline (its work at the replica's pace), the
        replica is pinged; one that answers is busy and the image goes on; one that does not is lost."""
        made = asyncio.ensure_future(_awaited(slot.replica.submit(request)))
        try:
            while True:
                done, _ = await asyncio.wait({made}, timeout=self.deadline(slot.s_per_image * cost))
                if done:
                    return made.result()
                silent = await self._unanswered(slot)
                if made.done():  # it came back meanwhile: whatever the ping said
                    return made.result()
                if silent is not None:
                    raise TimeoutError(f"an image of {cost:.2g} work ran past its deadline and {silent}")
                self._note("slow", slot, f"an image of {cost:.2g} work ran past its deadline; the replica answers")
        finally:
            made.cancel()

    async def _unanswered(self, slot: Slot) -> str | None:
        """None when every actor of the replica answers a ping within ``ping_s``, else why not; a replica
        without ``ping`` cannot say it is alive."""
        ping = getattr(slot.replica, "ping", None)
        if ping is None:
            return "the replica cannot be pinged"
        try:
            await asyncio.wait_for(asyncio.gather(*(_awaited(r) for r in ping())), self.ping_s)
        except TimeoutError:
            return f"did not answer a ping within {self.ping_s:g} s"
        except Exception as exc:
            return f"failed a ping: {type(exc).__name__}: {exc}"
        return None

    async def _lane(self, cost: float) -> tuple[Slot, float]:
        """Wait for a lane this image should start on (``_dispatch`` decides); the lane is held from then on."""
        future: asyncio.Future[tuple[Slot, float]] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(future, cost)
        if self.policy == "equal":
            waiter.slot = self._next_in_turn()
        self._waiting.append(waiter)
        self._dispatch()
        try:
            return await future
        except asyncio.CancelledError:  # the client went away: give back a lane handed to it meanwhile
            if future.done() and not future.cancelled() and future.exception() is None:
                self._release(*future.result(), cost)
            raise

    def _release(self, slot: Slot, began: float, cost: float) -> None:
        if (began, cost) in slot.started:
            slot.started.remove((began, cost))
        self._dispatch()

    def _next_in_turn(self) -> Slot | None:
        live = self.live()
        if not live:
            return None
        slot = live[self._turn % len(live)]
        self._turn += 1
        return slot

    def _dispatch(self) -> None:
        """Hand free lanes to waiting images (see the module's docstring); look again later while a lane idles
        beside waiting images."""
        self._waiting = deque(w for w in self._waiting if not w.future.done())
        if not self._waiting:
            if self._timer is not None:  # nothing waits: no look again (nor one left in a finished event loop)
                self._timer.cancel()
                self._timer = None
            return
        if not self.live():
            for waiter in self._waiting:
                if not waiter.future.done():
                    waiter.future.set_exception(NoReplica("no replica is serving (the last one was lost)"))
            self._waiting.clear()
            return
        now = time.monotonic()
        handed = self._equal() if self.policy == "equal" else self._plan(now)
        for waiter, slot in handed:
            slot.started.append((now, waiter.work))
            waiter.future.set_result((slot, now))
        self._waiting = deque(w for w in self._waiting if not w.future.done())
        idle = [s for s in self.live() if s.held < s.lanes]
        if self._waiting and idle and self.policy == "weighted" and self._timer is None:
            delay = min(max(0.1 * min(s.s_per_image for s in self.live()), RECHECK_S[0]), RECHECK_S[1])
            self._timer = asyncio.get_running_loop().call_later(delay, self._recheck)

    def _recheck(self) -> None:
        self._timer = None
        self._dispatch()

    def _equal(self) -> list[tuple[_Waiter, Slot]]:
        free = {s.index: s.lanes - s.held for s in self.live()}
        handed = []
        for waiter in self._waiting:
            if waiter.future.done():
                continue
            if waiter.slot is None or waiter.slot.state != "live":  # its replica was lost: the next in turn
                waiter.slot = self._next_in_turn()
            assert waiter.slot is not None  # live() is not empty here
            if free[waiter.slot.index] > 0:
                free[waiter.slot.index] -= 1
                handed.append((waiter, waiter.slot))
        return handed

    def _plan(self, now: float) -> list[tuple[_Waiter, Slot]]:
        """Earliest finish over every lane for the waiting images in order; those whose best lane is free now
        start now, the others wait (their lane is busy, or nobody's is free)."""
        costs = {slot.index: slot.cost(now) for slot in self.live()}  # seconds per unit of work
        lanes: list[tuple[float, bool, int, Slot]] = []  # (free in s, free now, index, slot) of every lane
        for slot in self.live():
            pace = costs[slot.index]
            lanes += [(max(pace * w - (now - t), 0.0), False, slot.index, slot) for t, w in slot.started]
            lanes += [(0.0, True, slot.index, slot)] * (slot.lanes - slot.held)
        handed = []
        for waiter in self._waiting:
            if waiter.future.done():
                continue
            need = waiter.work
            best = min(range(len(lanes)), key=lambda i: (lanes[i][0] + costs[lanes[i][2]] * need, not lanes[i][1], i))
            free_in, free_now, index, slot = lanes[best]
            if free_now:
                handed.append((waiter, slot))
            lanes[best] = (free_in + costs[index] * need, False, index, slot)
        return handed

    def lose(self, slot: Slot, exc: BaseException) -> None:
        """Take a replica out (its actors killed: a frozen one must not come back half-way)."""
        if slot.state == "lost":
            return
        slot.state, slot.lost_at = "lost", time.monotonic()
        slot.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
        self._note("lost", slot, slot.error)
        try:
            slot.replica.kill()
        except Exception as kill_error:  # already gone: nothing left to stop
            slot.error += f" (kill: {type(kill_error).__name__})"
        if self.regrow is not None:
            self.regrowing += 1
            task = asyncio.get_running_loop().create_task(self._regrow(slot))
            self._tasks.add(task)  # held until it ends (the loop keeps only weak references)
            task.add_done_callback(self._tasks.discard)

    async def _regrow(self, lost: Slot) -> None:
        """A new replica in place of ``lost``, built in the background; its failure noted, never raised."""
        assert self.regrow is not None
        try:
            new = await self.regrow(lost)
            if new is None:
                self._note("not re-grown", lost, "no node has room for another replica")
                return
            new.index = max(s.index for s in self.slots) + 1
            self.slots.append(new)
            self._note("re-grown", lost, f"by replica {new.index}")
            self._dispatch()
        except Exception as exc:
            self._note("re-growing failed", lost, f"{type(exc).__name__}: {exc}")
        finally:
            self.regrowing -= 1

    def _note(self, event: str, slot: Slot, why: str) -> None:
        self.events = [*self.events[-49:], {"at": time.time(), "event": event, "replica": slot.index, "why": why}]

    def health(self) -> str | None:
        """None while a replica serves or one is being re-grown (a rebuilt ingress would only place it again)."""
        return None if self.live() or self.regrowing else "no image replica is serving"

    def status(self) -> dict[str, Any]:
        return {
            "replicas": len(self.live()),
            "held": sum(s.held for s in self.slots),
            "held_work": round(self.held, 3),
            "regrowing": self.regrowing,
            "waiting": self.waiting,
            "pipelines": [s.to_json() for s in self.slots],
            "events": self.events[-20:],
        }


async def _awaited(ref: Awaitable[Any]) -> Any:
    return await ref
