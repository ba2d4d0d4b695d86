"""An image's cost is the client's choice: the router's deadlines and admission in work, the ping before a replica
counts as lost, its re-growth, the bounds on steps, size and memory, and the scheduler a folder may name.

Fake replicas on asyncio timers (their time proportional to the image's work, as a real UNet's is), so the
deadlines are exact; tests/local/test_serve_images.py runs the same on real Ray Serve with real actors.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")

from raycluster_cli.diffusion.parts import ImageRequest, check_scheduler
from raycluster_cli.diffusion.router import ImagePool, ImagesWaitingFull, NoReplica, Slot, work
from raycluster_cli.serve import image_limits
from raycluster_cli.serve.protocol import APIError

BASE = (20, 512 * 512)  # the calibration image: 20 steps at 512 × 512 (ImageRequest's default size)


def _units(request: ImageRequest) -> float:
    """Its time in calibration images, computed here (not by the router's ``work``, which is under test)."""
    return request.steps * request.height * request.width / (BASE[0] * BASE[1])


class WorkReplica:
    """Makes an image in ``seconds`` per unit of its work, one at a time; ``ping`` answers unless ``frozen``."""

    def __init__(self, seconds: float, frozen: bool = False) -> None:
        self.seconds, self.frozen = seconds, frozen
        self.actors: list[Any] = []
        self.made: list[int] = []
        self.killed = False
        self.lock: asyncio.Lock | None = None

    async def _make(self, request: ImageRequest) -> int:
        self.lock = self.lock or asyncio.Lock()
        async with self.lock:
            await asyncio.sleep(3600 if self.frozen else self.seconds * _units(request))
        self.made.append(request.seed)
        return request.seed

    def submit(self, request: ImageRequest) -> Any:
        return self._make(request)

    async def _pong(self) -> int:
        await asyncio.sleep(3600 if self.frozen else 0.001)
        return 1

    def ping(self) -> list[Any]:
        return [self._pong()]

    def kill(self) -> None:
        self.killed = True


def _pool(*replicas: WorkReplica, **options: Any) -> ImagePool:
    slots = [Slot(i, r, r.seconds, [{"node_id": f"n{i}"}]) for i, r in enumerate(replicas)]
    return ImagePool(slots, base=BASE, **options)


def test_work_is_steps_times_pixels_over_the_calibration_image() -> None:
    assert work(ImageRequest("a", 0, steps=20), BASE) == 1.0
    assert work(ImageRequest("a", 0, steps=500, height=1024, width=1024), BASE) == 100.0
    assert work(ImageRequest("a", 0, steps=10, height=256, width=512), BASE) == 0.25
    assert work(ImageRequest("a", 0, steps=500), None) == 1.0  # bench: every image is the calibration's


def test_an_image_of_many_steps_gets_a_deadline_scaled_by_its_work() -> None:
    """Calibrated at 0.01 s an image, deadline 3× its expected time: 25× the steps takes 0.25 s, within its
    scaled deadline (0.75 s); with the calibration image's deadline (0.03 s) it would be a lost replica."""
    replica = WorkReplica(0.01)
    pool = _pool(replica, deadline=lambda s: 3 * s)
    slow = ImageRequest("a", seed=7, steps=500)
    assert asyncio.run(pool.images([slow])) == [7]
    assert pool.slots[0].state == "live" and not replica.killed and pool.events == []
    assert pool.slots[0].s_per_image == pytest.approx(0.01, rel=0.5)  # learned per unit of work, not per image


def test_a_replica_past_its_deadline_that_answers_a_ping_is_busy_not_lost() -> None:
    replica = WorkReplica(0.3)  # 0.3 s an image, calibrated 0.3, deadline a flat 0.05 s
    pool = _pool(replica, deadline=lambda s: 0.05, ping_s=1.0)
    assert asyncio.run(pool.images([ImageRequest("a", seed=3)])) == [3]
    assert pool.slots[0].state == "live" and not replica.killed
    assert {e["event"] for e in pool.events} == {"slow"}


def test_a_replica_that_does_not_answer_the_ping_is_lost_and_the_image_moves() -> None:
    frozen, alive = WorkReplica(0.01, frozen=True), WorkReplica(0.02)
    pool = _pool(frozen, alive, deadline=lambda s: 0.1, ping_s=0.1)
    pool.slots[1].s_per_image = 1.0  # the frozen one looks fastest: the image goes there first
    assert asyncio.run(pool.images([ImageRequest("a", seed=0)])) == [0]
    assert frozen.killed and pool.slots[0].state == "lost" and "did not answer a ping" in pool.slots[0].error


def test_admission_counts_work_not_requests() -> None:
    """``max_waiting`` 4: one image of 4× the steps holds all of it, so one more small image is refused (counted
    in requests, 1 + 1 of 4 would pass); once it is made the small one is taken."""
    pool = _pool(WorkReplica(0.02), max_waiting=4)

    async def run() -> None:
        big = asyncio.ensure_future(pool.images([ImageRequest("a", seed=0, steps=80)]))
        await asyncio.sleep(0.01)
        assert pool.held == pytest.approx(4.0)
        with pytest.raises(ImagesWaitingFull, match=r"4\.0 image"):
            await pool.images([ImageRequest("b", seed=1)])
        assert await big == [0]
        assert await pool.images([ImageRequest("b", seed=1)]) == [1]

    asyncio.run(run())


def test_a_lost_replica_is_regrown_and_serves_again() -> None:
    lost, new = WorkReplica(0.01, frozen=True), WorkReplica(0.01)
    asked: list[int] = []

    async def regrow(slot: Slot) -> Slot:
        asked.append(slot.index)
        await asyncio.sleep(0.05)
        return Slot(-1, new, 0.01, [{"node_id": "n9"}])

    pool = _pool(lost, deadline=lambda s: 0.05, ping_s=0.05, regrow=regrow)

    async def run() -> None:
        with pytest.raises(NoReplica):
            await pool.images([ImageRequest("a", seed=0)])
        assert pool.health() is None and pool.regrowing == 1  # on its way back: not unhealthy
        for _ in range(100):
            if pool.live():
                break
            await asyncio.sleep(0.01)
        assert await pool.images([ImageRequest("a", seed=5)]) == [5]

    asyncio.run(run())
    assert asked == [0] and new.made == [5] and [s.index for s in pool.live()] == [1]
    assert [e["event"] for e in pool.events] == ["lost", "re-grown"] and pool.regrowing == 0


def test_steps_and_pixels_over_the_operators_bounds_are_400_naming_the_field() -> None:
    image_limits.check_steps(150, 150)
    with pytest.raises(APIError) as steps:
        image_limits.check_steps(500, 150)
    assert steps.value.status == 400 and steps.value.param == "num_inference_steps"
    assert "--image-max-steps" in steps.value.message
    image_limits.check_pixels(1024, 1024, 1024 * 1024)
    with pytest.raises(APIError) as size:
        image_limits.check_pixels(2048, 1024, 1024 * 1024)
    assert size.value.param == "size" and "--image-max-pixels" in size.value.message
    assert image_limits.largest_side(1024 * 1024, 8) == 2048
    assert image_limits.operator_problem(20, 512, 150, 1024 * 1024) is None
    assert "--image-max-steps" in str(image_limits.operator_problem(200, 512, 150, 1024 * 1024))
    assert "--image-max-pixels" in str(image_limits.operator_problem(20, 512, 150, 100))


def test_a_size_whose_memory_does_not_fit_a_replica_is_refused() -> None:
    """A replica measured 1 MiB of working memory at 256 × 256 (16 bytes a pixel) on a node with 1 GiB room,
    100 MiB of weights: it holds ~47 M pixels less the margin; one with 20 MiB room less weights holds 0.5 M."""
    mib = 1024 * 1024
    weights = {"text": 10 * mib, "unet": 60 * mib, "vae": 10 * mib}
    parts = ["text", "unet", "vae"]
    roomy = image_limits.replica_limits([{"work_bytes": mib}], {"a": 1024 * mib}, [("a", parts)], weights, 256**2)
    assert roomy["work_bytes_per_pixel"] == 16 and roomy["memory_source"] == "measured"
    assert roomy["fits_pixels"] == int((1024 * mib - 96 * mib) / (16 * image_limits.MEMORY_MARGIN))
    tight = image_limits.replica_limits([{"work_bytes": mib}], {"b": 106 * mib}, [("b", parts)], weights, 256**2)
    slots = [Slot(0, WorkReplica(1), 1, []), Slot(1, WorkReplica(1), 1, [])]
    slots[0].limits, slots[1].limits = roomy, tight
    image_limits.check_memory(512, 512, slots)
    with pytest.raises(APIError) as refused:
        image_limits.check_memory(1024, 1024, slots)
    assert refused.value.status == 400 and refused.value.param == "size" and "replica 1" in refused.value.message
    unmeasured = image_limits.replica_limits([{"work_bytes": None}], {"a": 1024 * mib}, [("a", parts)], weights, 512**2)
    assert unmeasured["memory_source"] == "estimate" and unmeasured["work_bytes_per_pixel"] == 3072


def _folder(tmp_path: Path, scheduler: Any) -> Path:
    (tmp_path / "model_index.json").write_text(
        json.dumps({"_class_name": "StableDiffusionPipeline", "scheduler": scheduler})
    )
    return tmp_path


@pytest.mark.parametrize(
    "named",
    [
        ["diffusers", "StableDiffusionPipeline"],
        ["diffusers", "AutoencoderKL"],
        ["diffusers", "__loader__"],
        ["transformers", "DDIMScheduler"],
        ["diffusers", "NoSuchScheduler"],
        "DDIMScheduler",
    ],
)
def test_a_folder_naming_anything_but_a_diffusers_scheduler_is_refused(tmp_path: Path, named: Any) -> None:
    pytest.importorskip("diffusers")
    with pytest.raises(ValueError) as refused:
        check_scheduler(_folder(tmp_path, named))
    message = str(refused.value)
    assert "model_index.json" in message and '"scheduler"' in message and "not a diffusers scheduler" in message
    assert "\n" not in message


def test_a_diffusers_scheduler_is_taken(tmp_path: Path) -> None:
    pytest.importorskip("diffusers")
    check_scheduler(_folder(tmp_path, ["diffusers", "DDIMScheduler"]))
    check_scheduler(_folder(tmp_path, ["diffusers", "EulerDiscreteScheduler"]))
