"""The image service's replicas: each image routed by measured speed, moved when its replica is lost.

The replicas are the bench's (``bench.diffusion_workers.Replica``: a whole pipeline on one node, or its parts as
stages on three), placed and timed by the bench's own ``place`` and ``calibrate``.  Each image goes to the replica
where it would finish first given what that replica already holds (``routing.pick``: ``(held + 1) × seconds per
image``), so a node 4× faster makes 4× the images under load, and a lone request goes to the fastest node.  One
request's ``n`` images are ``n`` separate images (seed, seed + 1, …), spread like any others.

The seconds per image start at the calibration's and then follow what each replica shows while serving: every
image that comes back gives a sample (from when it could start there — its submission, or the replica's previous
image coming back if that was later — to its return; under a backlog, the replica's time between images), folded in
with weight ``LEARN``.  A calibration taken while the machine was loaded differently (on the lab: the 0.25-CPU
host timed faster than the 0.5-CPU one) is so corrected by the traffic itself (docs/PERFORMANCE.md, S10).

A replica whose actor died, or whose image did not come back within its deadline (a frozen node), is taken out
and its image is made again on another one: the image depends only on its request, so a moved image is the same
image.  With no replica left the service answers 503 and ``check_health`` fails, so Ray Serve rebuilds the ingress,
which places the replicas again on the nodes alive then.  Pure asyncio over awaitable object refs (no Ray call),
so the routing is tested with fakes as well as on Ray.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ray.exceptions import ObjectLostError, RayActorError

from raycluster_cli.bench.diffusion import ImageRequest
from raycluster_cli.bench.routing import pick

LOST = (RayActorError, ObjectLostError, TimeoutError)  # the replica is gone (or frozen): move the image
MAX_ATTEMPTS = 3  # an image moved this often fails: something other than one node is wrong
LEARN = 0.2  # the weight of each served image's time in a replica's seconds per image


class QueueFull(Exception):
    """More images waiting than the service takes: a 503 with Retry-After."""


class NoReplica(Exception):
    """No replica is serving: a 503 with Retry-After."""


class ReplicaLike(Protocol):
    actors: list[Any]

    def submit(self, request: ImageRequest) -> Awaitable[Any]: ...

    def kill(self) -> None: ...


@dataclass
class Slot:
    """One replica as the router sees it: its measured speed, what it holds now, what it made."""

    index: int
    replica: ReplicaLike
    s_per_image: float
    holders: list[dict[str, Any]]  # [{"node_id", "node_ip", "parts"}]
    held: int = 0
    served: int = 0
    state: str = "live"  # live | lost
    error: str = ""
    lost_at: float | None = None
    calibrated_s: float = 0.0  # the calibration's seconds per image (``s_per_image`` then follows the traffic)
    last_done: float | None = None

    def __post_init__(self) -> None:
        self.calibrated_s = self.calibrated_s or self.s_per_image

    def learn(self, submitted: float, now: float) -> None:
        """Fold one served image's time into ``s_per_image`` (see the module's docstring)."""
        began = max(submitted, self.last_done) if self.last_done is not None else submitted
        self.last_done = now
        if now > began:
            self.s_per_image = (1 - LEARN) * self.s_per_image + LEARN * (now - began)

    def to_json(self) -> dict[str, Any]:
        row = {
            "index": self.index, "state": self.state, "s_per_image": self.s_per_image, "held": self.held,
            "served": self.served, "stages": self.holders, "calibrated_s_per_image": self.calibrated_s,
        }  # fmt: skip
        return row | ({"error": self.error} if self.error else {})


@dataclass
class ImagePool:
    slots: list[Slot]
    max_waiting: int = 64  # images held across all replicas before new requests get 503
    # seconds an image may take on its replica, given the seconds of work ahead of it and its own there
    deadline: Callable[[float], float] = lambda s: max(60.0, 20 * s)
    events: list[dict[str, Any]] = field(default_factory=list)

    def live(self) -> list[Slot]:
        return [s for s in self.slots if s.state == "live"]

    @property
    def held(self) -> int:
        return sum(s.held for s in self.slots)

    def choose(self) -> Slot | None:
        live = self.live()
        if not live:
            return None
        return live[pick([s.held for s in live], [s.s_per_image for s in live])]

    async def images(self, requests: Sequence[ImageRequest]) -> list[Any]:
        """Every request's image (each a (1, H, W, 3) float array in [0, 1]), routed one by one; the whole call
        is refused up front when the service already holds ``max_waiting`` images."""
        if self.held + len(requests) > self.max_waiting and self.held > 0:
            raise QueueFull(f"{self.held} image(s) in progress, at most {self.max_waiting} held")
        if not self.live():
            raise NoReplica("no replica is serving")
        return list(await asyncio.gather(*(self.image(r) for r in requests)))

    async def image(self, request: ImageRequest) -> Any:
        for _ in range(MAX_ATTEMPTS):
            slot = self.choose()
            if slot is None:
                raise NoReplica("no replica is serving (the last one was lost)")
            slot.held += 1
            limit = self.deadline(slot.s_per_image * slot.held)  # it waits behind the images the replica holds
            submitted = time.monotonic()
            try:
                out = await asyncio.wait_for(_awaited(slot.replica.submit(request)), limit)
            except LOST as exc:
                self.lose(slot, exc)
                continue
            finally:
                slot.held -= 1
            slot.served += 1
            slot.learn(submitted, time.monotonic())
            return out
        raise NoReplica(f"the image failed on {MAX_ATTEMPTS} replicas")

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
            "held": self.held,
            "pipelines": [s.to_json() for s in self.slots],
            "events": self.events[-20:],
        }


async def _awaited(ref: Awaitable[Any]) -> Any:
    return await ref
