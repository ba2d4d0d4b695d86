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

from raycluster_cli.bench.diffusion import ImageRequest
from raycluster_cli.serve.image_pool import ImagePool, NoReplica, QueueFull, Slot
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
    assert (len(fast.made), len(slow.made)) == (16, 4)
    assert [s.served for s in pool.slots] == [16, 4] and pool.held == 0


def test_a_wrong_calibration_is_corrected_by_the_images_served() -> None:
    """Calibrated 1 : 4 the wrong way round (as a loaded machine can time them): after a few waves of images the
    shares follow the replicas' real speeds."""
    slow, fast = FakeReplica(0.04), FakeReplica(0.01)
    slots = [
        Slot(0, slow, 0.01, [{"node_ip": "10.0.0.0"}]),  # calibrated fast, really slow
        Slot(1, fast, 0.04, [{"node_ip": "10.0.0.1"}]),
    ]
    pool = ImagePool(slots, max_waiting=100)

    async def waves() -> list[tuple[int, int]]:
        shares = []
        for _ in range(8):
            before = (len(slow.made), len(fast.made))
            await pool.images(_requests(5))
            shares.append((len(slow.made) - before[0], len(fast.made) - before[1]))
        return shares

    shares = asyncio.run(waves())
    assert shares[0] == (4, 1)  # the calibration's routing
    assert all(fast_made >= 4 for _, fast_made in shares[-3:]), shares  # the real one
    assert slots[0].s_per_image > slots[1].s_per_image
    assert [s["calibrated_s_per_image"] for s in pool.status()["pipelines"]] == [0.01, 0.04]


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
        with pytest.raises(QueueFull):
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
