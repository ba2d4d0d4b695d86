"""The image service's routing and failover over fake replicas (asyncio timers for images), and its request shape.

In addition to tests/local/test_serve_images.py (real Ray Serve, real actors, real kills); here the speeds are
exact, so the share each replica makes is checked exactly.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("ray")
from ray.exceptions import RayActorError

from raycluster_cli.diffusion.parts import ImageRequest
from raycluster_cli.diffusion.router import ImagePool, ImagesWaitingFull, NoReplica, Slot
from raycluster_cli.serve.protocol import APIError, ImageGenerationRequest, parse


class FakeReplica:
    """Makes an image (its request's seed) in ``seconds``, one at a time as a Ray actor does; a dead one raises as a
    killed actor's ref does."""

    def __init__(self, seconds: float, dead: bool = False, frozen: bool = False) -> None:
        self.seconds, self.dead, self.frozen = seconds, dead, frozen
        self.actors: list[Any] = []
        self.made: list[int] = []
        self.killed = False
        self.lock: asyncio.Lock | None = None

    async def _make(self, request: ImageRequest) -> Any:
        if self.dead:
            raise RayActorError()
        self.lock = self.lock or asyncio.Lock()
        async with self.lock:
            await asyncio.sleep(3600 if self.frozen else self.seconds)
        self.made.append(request.seed)
        return request.seed

    def submit(self, request: ImageRequest) -> Any:
        return self._make(request)

    def kill(self) -> None:
        self.killed = True


def _pool(*replicas: FakeReplica, **options: Any) -> ImagePool:
    slots = [
        Slot(i, r, r.seconds, [{"node_ip": f"10.0.0.{i}", "parts": ["text", "unet", "vae"]}])
        for i, r in enumerate(replicas)
    ]
    return ImagePool(slots, **options)


def _requests(count: int) -> list[ImageRequest]:
    return [ImageRequest("a cat", seed=i) for i in range(count)]


def test_a_replica_four_times_faster_makes_four_times_the_images() -> None:
    fast, slow = FakeReplica(0.01), FakeReplica(0.04)
    pool = _pool(fast, slow, max_waiting=100)
    made = asyncio.run(pool.images(_requests(20)))
    assert made == list(range(20))  # each request's own image, in request order
    assert len(fast.made) in (15, 16, 17) and len(fast.made) + len(slow.made) == 20  # 16 : 4, give or take the tail
    assert abs(len(fast.made) * 0.01 - len(slow.made) * 0.04) <= 0.04 + 1e-9  # both busy until the end
    assert [s.served for s in pool.slots] == [len(fast.made), len(slow.made)] and pool.held == 0


def test_a_burst_on_a_wrong_calibration_still_goes_by_the_real_speeds() -> None:
    """21 images at once, the replicas calibrated 1 : 4 the wrong way round (as a loaded machine can time them).
    Bound at arrival, the burst went by the calibration (17 images on the slow replica, 0.68 s); bound late, each
    lane takes the next image when free, so the fast replica makes most of them and both end together."""
    slow, fast = FakeReplica(0.04), FakeReplica(0.01)
    slots = [
        Slot(0, slow, 0.01, [{"node_ip": "10.0.0.0"}]),  # calibrated fast, really slow
        Slot(1, fast, 0.04, [{"node_ip": "10.0.0.1"}]),
    ]
    pool = ImagePool(slots, max_waiting=100)

    async def timed() -> float:
        began = asyncio.get_running_loop().time()
        assert await pool.images(_requests(21)) == list(range(21))
        return asyncio.get_running_loop().time() - began

    wall = asyncio.run(timed())
    assert len(fast.made) >= 15, (slow.made, fast.made)  # ideal 16.8 : 4.2
    assert wall < 0.26, wall  # ideal 0.168 s; bound at arrival: 17 × 0.04 = 0.68 s
    assert slots[0].s_per_image > slots[1].s_per_image  # and the estimates followed
    assert [s["calibrated_s_per_image"] for s in pool.status()["pipelines"]] == [0.01, 0.04]


def test_a_replica_that_slows_down_stops_getting_images_while_it_is_slow() -> None:
    """Both calibrated near 0.05 s; the first replica's image takes 0.5 s.  While it runs past its estimate, the
    images wait for the other replica's lane, not behind it (without the elapsed time counted they would: its
    estimate 0.03 s would keep looking shorter than the other's 0.05 s)."""
    stuck, steady = FakeReplica(0.5), FakeReplica(0.05)
    slots = [Slot(0, stuck, 0.03, [{"node_ip": "10.0.0.0"}]), Slot(1, steady, 0.05, [{"node_ip": "10.0.0.1"}])]
    pool = ImagePool(slots, max_waiting=100)

    async def timed() -> float:
        began = asyncio.get_running_loop().time()
        await pool.images(_requests(6))
        return asyncio.get_running_loop().time() - began

    wall = asyncio.run(timed())
    assert (len(stuck.made), len(steady.made)) == (1, 5), (stuck.made, steady.made)
    assert wall < 0.6, wall  # the stuck image's 0.5 s, the other five beside it (0.25 s)


def test_equal_routing_is_a_round_robin_whatever_the_speeds() -> None:
    fast, slow = FakeReplica(0.01), FakeReplica(0.04)
    pool = _pool(fast, slow, max_waiting=100, policy="equal")
    assert asyncio.run(pool.images(_requests(8))) == list(range(8))
    assert (sorted(fast.made), sorted(slow.made)) == ([0, 2, 4, 6], [1, 3, 5, 7])
    with pytest.raises(ValueError, match="'fastest'"):
        _pool(fast, policy="fastest")


def test_a_client_that_goes_away_while_waiting_gives_its_turn_back() -> None:
    one = FakeReplica(0.05)
    pool = _pool(one, max_waiting=100)

    async def run() -> None:
        first = asyncio.ensure_future(pool.image(ImageRequest("a", seed=0)))
        gone = asyncio.ensure_future(pool.image(ImageRequest("b", seed=1)))
        await asyncio.sleep(0.01)
        assert pool.waiting == 1
        gone.cancel()
        assert await pool.image(ImageRequest("c", seed=2)) == 2
        assert await first == 0

    asyncio.run(run())
    assert one.made == [0, 2] and pool.held == 0


def test_a_lone_request_goes_to_the_fastest_replica() -> None:
    slow, fast = FakeReplica(0.05), FakeReplica(0.01)
    asyncio.run(_pool(slow, fast).images(_requests(1)))
    assert (slow.made, fast.made) == ([], [0])


def test_a_dead_replica_is_taken_out_and_its_images_are_made_elsewhere() -> None:
    dead, alive = FakeReplica(0.01, dead=True), FakeReplica(0.02)
    pool = _pool(dead, alive)
    assert asyncio.run(pool.images(_requests(3))) == [0, 1, 2]
    assert dead.killed and pool.slots[0].state == "lost" and "RayActorError" in pool.slots[0].error
    assert sorted(alive.made) == [0, 1, 2] and pool.events[-1]["event"] == "lost"
    assert pool.health() is None and pool.status()["replicas"] == 1


def test_a_frozen_replica_times_out_and_is_replaced_by_another() -> None:
    frozen, alive = FakeReplica(0.01, frozen=True), FakeReplica(0.02)
    pool = _pool(frozen, alive, deadline=lambda s: 0.2)
    assert asyncio.run(pool.images(_requests(1))) == [0]
    assert frozen.killed and pool.slots[0].state == "lost" and "TimeoutError" in pool.slots[0].error


def test_no_replica_left_is_no_replica_and_unhealthy() -> None:
    pool = _pool(FakeReplica(0.01, dead=True))
    with pytest.raises(NoReplica):
        asyncio.run(pool.images(_requests(1)))
    assert pool.health() == "no image replica is serving"
    with pytest.raises(NoReplica):
        asyncio.run(pool.images(_requests(1)))


def test_more_than_max_waiting_images_is_refused_while_busy() -> None:
    pool = _pool(FakeReplica(0.2), max_waiting=3)

    async def run() -> None:
        first = asyncio.ensure_future(pool.images(_requests(2)))
        await asyncio.sleep(0.05)
        with pytest.raises(ImagesWaitingFull):
            await pool.images(_requests(2))
        await first

    asyncio.run(run())


def test_the_request_shape_sizes_and_the_refused_url_format() -> None:
    body = parse(ImageGenerationRequest, b'{"prompt": "a cat", "n": 2, "size": "512x256", "style": "vivid"}')
    assert body.n == 2 and body.dimensions(512, 8, 1024) == (512, 256)
    assert parse(ImageGenerationRequest, b'{"prompt": "a cat"}').dimensions(64, 8, 1024) == (64, 64)
    for size in ("512", "500x512", "2048x2048", "0x0"):
        with pytest.raises(APIError) as bad:
            parse(ImageGenerationRequest, f'{{"prompt": "a cat", "size": "{size}"}}'.encode()).dimensions(512, 8, 1024)
        assert bad.value.status == 400 and bad.value.param == "size"
    with pytest.raises(APIError) as url:
        parse(ImageGenerationRequest, b'{"prompt": "a cat", "response_format": "url"}')
    assert url.value.param == "response_format" and "b64_json" in url.value.message
    with pytest.raises(APIError) as many:
        parse(ImageGenerationRequest, b'{"prompt": "a cat", "n": 11}')
    assert many.value.param == "n"


def test_image_dtypes_auto_is_float32_and_float16_is_refused_with_the_choices() -> None:
    from raycluster_cli.serve.image_launch import image_dtype

    assert image_dtype("auto") == "float32" and image_dtype("bfloat16") == "bfloat16"
    with pytest.raises(SystemExit, match="--dtype float16 is not offered for images: use one of auto, float32"):
        image_dtype("float16")
