"""Images to replicas of unequal speed, bound late: each image goes to a replica only when that replica can start it.

Used by `bench`'s counted runs on a diffusers checkpoint and by the image service (serve/image_app.py), so the
benchmark measures the router the service runs.  The replicas are ``bench.diffusion_workers.Replica`` (a whole
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

One request's ``n`` images are ``n`` separate images (seed, seed + 1, …), routed like any others.  Seconds per
image start at the calibration's and follow each served image (its time on the lane, folded in with
weight ``LEARN``).  ``policy="equal"`` is the reference a speed-weighted run is compared with: image k waits for
replica k mod n, as a round robin does.

A replica whose actor died, or whose image did not come back within its deadline (a frozen node), is taken out and
its image made again on another one: the image depends only on its request, so a moved image is the same image.  With
no replica left every waiting image fails with ``NoReplica`` (the service answers 503 and ``check_health`` fails, so
Ray Serve rebuilds the ingress, which places the replicas again on the nodes alive then).  Pure asyncio over
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

from raycluster_cli.bench.diffusion import ImageRequest

LOST = (RayActorError, ObjectLostError, TimeoutError)  # the replica is gone (or frozen): move the image
MAX_ATTEMPTS = 3  # an image moved this often fails: something other than one node is wrong
LEARN = 0.2  # the weight of each served image's time in a replica's seconds per image
RECHECK_S = (0.005, 0.5)  # bounds of the wait before looking again while a lane idles beside waiting images


class QueueFull(Exception):
    """More images waiting than the service takes: a 503 with Retry-After."""


class NoReplica(Exception):
    """No replica is serving: a 503 with Retry-After."""


class ReplicaLike(Protocol):
    actors: list[Any]

    def submit(self, request: ImageRequest) -> Awaitable[Any]: ...

    def kill(self) -> None: ...


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
    started: list[float] = field(default_factory=list)  # monotonic start of each image on a lane now
    served: int = 0
    state: str = "live"  # live | lost
    error: str = ""
    lost_at: float | None = None
    calibrated_s: float = 0.0  # the calibration's seconds per image (``s_per_image`` then follows the traffic)

    def __post_init__(self) -> None:
        self.calibrated_s = self.calibrated_s or self.s_per_image

    @property
    def held(self) -> int:
        return len(self.started)

    def learn(self, seconds: float) -> None:
        """Fold one served image's time on its lane into ``s_per_image``."""
        if seconds > 0:
            self.s_per_image = (1 - LEARN) * self.s_per_image + LEARN * seconds

    def cost(self, now: float) -> float:
        """Seconds an image takes here: the estimate, or longer if an image on a lane has already run longer."""
        return max([self.s_per_image, *(now - t for t in self.started)])

    def to_json(self) -> dict[str, Any]:
        row = {
            "index": self.index, "state": self.state, "s_per_image": self.s_per_image, "held": self.held,
            "served": self.served, "stages": self.holders, "calibrated_s_per_image": self.calibrated_s,
            "lanes": self.lanes,
        }  # fmt: skip
        return row | ({"error": self.error} if self.error else {})


@dataclass
class _Waiter:
    future: asyncio.Future[tuple[Slot, float]]
    slot: Slot | None = None  # the equal policy's replica, fixed on arrival


@dataclass
class ImagePool:
    slots: list[Slot]
    max_waiting: int = 64  # images held (on lanes and waiting) before new requests get 503
    # seconds an image may take on its lane, given its replica's seconds per image
    deadline: Callable[[float], float] = lambda s: max(60.0, 20 * s)
    policy: str = "weighted"  # or "equal": the round robin a weighted run is compared with
    events: list[dict[str, Any]] = field(default_factory=list)
    observe: Callable[[Slot, float], None] | None = None  # called with each served image's slot and lane seconds
    _waiting: deque[_Waiter] = field(default_factory=deque, init=False, repr=False)
    _turn: int = field(default=0, init=False, repr=False)
    _timer: asyncio.TimerHandle | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.policy not in ("weighted", "equal"):
            raise ValueError(f"routing policy {self.policy!r}: use 'weighted' or 'equal'")

    def live(self) -> list[Slot]:
        return [s for s in self.slots if s.state == "live"]

    @property
    def held(self) -> int:
        """Images on the replicas' lanes and waiting for one."""
        return sum(s.held for s in self.slots) + self.waiting

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiting if not w.future.done())

    async def images(self, requests: Sequence[ImageRequest]) -> list[Any]:
        """Every request's image (each a (1, H, W, 3) float array in [0, 1]), in request order; the whole call is
        refused up front when the service already holds ``max_waiting`` images."""
        if self.held + len(requests) > self.max_waiting and self.held > 0:
            raise QueueFull(f"{self.held} image(s) in progress, at most {self.max_waiting} held")
        if not self.live():
            raise NoReplica("no replica is serving")
        return list(await asyncio.gather(*(self.image(r) for r in requests)))

    async def image(self, request: ImageRequest) -> Any:
        for _ in range(MAX_ATTEMPTS):
            slot, began = await self._lane()
            try:
                out = await asyncio.wait_for(_awaited(slot.replica.submit(request)), self.deadline(slot.s_per_image))
            except LOST as exc:
                self.lose(slot, exc)
                continue
            finally:
                self._release(slot, began)
            seconds = time.monotonic() - began
            slot.served += 1
            slot.learn(seconds)
            if self.observe is not None:
                self.observe(slot, seconds)
            return out
        raise NoReplica(f"the image failed on {MAX_ATTEMPTS} replicas")

    async def _lane(self) -> tuple[Slot, float]:
        """Wait for a lane this image should start on (``_dispatch`` decides); the lane is held from then on."""
        future: asyncio.Future[tuple[Slot, float]] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(future)
        if self.policy == "equal":
            waiter.slot = self._next_in_turn()
        self._waiting.append(waiter)
        self._dispatch()
        try:
            return await future
        except asyncio.CancelledError:  # the client went away: give back a lane handed to it meanwhile
            if future.done() and not future.cancelled() and future.exception() is None:
                self._release(*future.result())
            raise

    def _release(self, slot: Slot, began: float) -> None:
        if began in slot.started:
            slot.started.remove(began)
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
            slot.started.append(now)
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
        costs = {slot.index: slot.cost(now) for slot in self.live()}
        lanes: list[tuple[float, bool, int, Slot]] = []  # (free in s, free now, index, slot) of every lane
        for slot in self.live():
            lanes += [(max(costs[slot.index] - (now - t), 0.0), False, slot.index, slot) for t in slot.started]
            lanes += [(0.0, True, slot.index, slot)] * (slot.lanes - slot.held)
        handed = []
        for waiter in self._waiting:
            if waiter.future.done():
                continue
            best = min(range(len(lanes)), key=lambda i: (lanes[i][0] + costs[lanes[i][2]], not lanes[i][1], i))
            free_in, free_now, index, slot = lanes[best]
            if free_now:
                handed.append((waiter, slot))
            lanes[best] = (free_in + costs[index], False, index, slot)
        return handed

    def lose(self, slot: Slot, exc: BaseException) -> None:
        """Take a replica out (its actors killed: a frozen one must not come back half-way)."""
        if slot.state == "lost":
            return
        slot.state, slot.lost_at = "lost", time.monotonic()
        slot.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
        self.events = [
            *self.events[-49:],
            {"at": time.time(), "event": "lost", "replica": slot.index, "why": slot.error},
        ]
        try:
            slot.replica.kill()
        except Exception as kill_error:  # already gone: nothing left to stop
            slot.error += f" (kill: {type(kill_error).__name__})"

    def health(self) -> str | None:
        return None if self.live() else "no image replica is serving"

    def status(self) -> dict[str, Any]:
        return {
            "replicas": len(self.live()),
            "held": sum(s.held for s in self.slots),
            "waiting": self.waiting,
            "pipelines": [s.to_json() for s in self.slots],
            "events": self.events[-20:],
        }


async def _awaited(ref: Awaitable[Any]) -> Any:
    return await ref
