"""The image service: a Ray Serve ingress that speaks OpenAI's images API over the bench's diffusion replicas.

``POST /v1/images/generations`` answers PNGs inline (``b64_json``), ``/v1/models`` lists the checkpoint, and
``/raycluster/status`` shows the placement, each replica's measured seconds per image, what it holds and made,
and each actor's busy time.  The same keys as the text routes (the service's own, serve/auth.py), same error shape, 503 with
Retry-After when full or when no replica serves.

The ingress places the replicas itself, when it is built (``diffusion.placing.place`` on the alive nodes' `memory`),
and times each on a real image (``diffusion.placing.calibrate``): so the service is up only once a real image went
through every replica, and a rebuilt ingress (Ray Serve's answer to a failed ``check_health``) re-places on the
nodes alive then.  A replica lost while serving is re-grown in the background the same way (placed on the alive
nodes no live replica uses, timed on a real image).  What a request may cost is bounded (``image_limits``: steps,
pixels, and the memory its size needs on a replica), and the router counts and times it by its work (steps ×
pixels over the calibration image's, ``image_pool.work``).  The stage code is the bench's (``diffusion.parts``), so the service's image is the bench's,
which equals diffusers' own pipeline's.

No ``from __future__ import annotations``: FastAPI reads the route methods' annotations at runtime (serve/app.py).
The key check and the error shape are the text service's own, from serve/ingress.py.
"""

import asyncio
import base64
import io
import secrets
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request
from ray import serve
from ray.exceptions import RayTaskError

from raycluster_cli.diffusion import placing
from raycluster_cli.diffusion.parts import ImageRequest, part_bytes, vae_scale_factor
from raycluster_cli.diffusion.router import ImagePool, ImagesWaitingFull, NoReplica, Slot, lanes_of
from raycluster_cli.serve import image_limits, protocol
from raycluster_cli.serve.auth import ServiceKeys, cluster_token_path
from raycluster_cli.serve.ingress import KEYED, openai_api
from raycluster_cli.serve.metrics import RayRecorder, image_request
from raycluster_cli.serve.protocol import APIError, ImageGenerationRequest

RETRY_AFTER_S = 2
COUNTERS_S = 10.0
CALIBRATION_PROMPT = "a red house on the hill"
REGROW_S = 900.0  # placing, loading and timing a replica in place of a lost one
MULTIPLE = 8  # width and height: diffusers' StableDiffusionPipeline refuses others


@dataclass(frozen=True)
class ImageSettings:
    """What the image service serves and its defaults for what a request leaves out."""

    model_path: str
    model_id: str = ""
    keys_file: str | None = None  # the service's keys document (raycluster_cli.apikeys); None: no auth (tests)
    dtype: str = "float32"
    steps: int = 20  # denoising steps when a request does not say (num_inference_steps)
    guidance: float = 7.5
    size: int | None = None  # default width and height; None: the checkpoint's own (UNet sample size × VAE factor)
    max_steps: int = 150  # the most num_inference_steps a request may ask
    max_pixels: int = 1024 * 1024  # the most width × height a request may ask
    num_threads: int | None = None
    calibration_repeats: int = 1
    max_waiting: float = 64  # work held (in images of the default steps and size) before requests get 503
    deadline_floor_s: float = 60.0  # the least an image may run before its replica is pinged
    regrow: bool = True  # a lost replica is replaced in the background

    @property
    def served_model(self) -> str:
        return self.model_id or Path(self.model_path).name


def native_size(path: str) -> int:
    """The checkpoint's own image size, as diffusers picks it: the UNet's sample size × the VAE's factor."""
    import json

    unet = json.loads((Path(path) / "unet" / "config.json").read_text())
    sample = unet.get("sample_size", 64)
    return int((sample[0] if isinstance(sample, list) else sample) * vae_scale_factor(path))


def png_b64(image: Any) -> str:
    """One (H, W, 3) float image in [0, 1] as base64 PNG, converted as diffusers' ``output_type="pil"`` does."""
    from diffusers.image_processor import VaeImageProcessor

    buffer = io.BytesIO()
    VaeImageProcessor.numpy_to_pil(image[None] if image.ndim == 3 else image)[0].save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@dataclass(frozen=True)
class Placed:
    holders: list[placing.Holders]
    why: str
    ip_of: dict[str, str]
    room_of: dict[str, int]  # bytes a part may take on each node


def _place(settings: ImageSettings, size: int) -> Placed:
    rooms = placing.node_rooms()
    holders, why = placing.place(rooms, part_bytes(settings.model_path), size)
    return Placed(holders, why, {n.node_id: n.node_ip for n in rooms}, {n.node_id: n.capacity for n in rooms})


image_api = openai_api("raycluster serve (images)")  # the text routes' error shape and key check (serve/ingress.py)


@serve.deployment(max_ongoing_requests=256, ray_actor_options={"num_cpus": 0}, health_check_timeout_s=60)
@serve.ingress(image_api)
class ImageServer:
    """One ingress: the replicas of the diffusion pipeline (bench actors on the nodes) and the routing over them."""

    async def __init__(self, settings: ImageSettings) -> None:  # type: ignore[misc]  # Serve awaits it
        self.settings = settings
        self.keys = ServiceKeys(settings.keys_file, cluster_token_path())
        self.model_id = settings.served_model
        self.size = settings.size or native_size(settings.model_path)
        self.weights = part_bytes(settings.model_path)
        placed = await asyncio.to_thread(_place, settings, self.size)
        self.why = placed.why
        slots = await asyncio.to_thread(self._timed, placed.holders, placed)
        self.calibration = {"steps": settings.steps, "size": self.size, "guidance_scale": settings.guidance}
        self.pool = ImagePool(
            slots, max_waiting=settings.max_waiting, deadline=lambda s: max(settings.deadline_floor_s, 20 * s),
            base=(settings.steps, self.size * self.size), regrow=self._regrow if settings.regrow else None,
        )  # fmt: skip
        self.created = int(time.time())
        self.metrics = RayRecorder()

    def _timed(self, holders: list[placing.Holders], placed: Placed) -> list[Slot]:
        """Replicas on ``holders``, each timed on a real image (the service starts only once each generates),
        with the memory it measured and so the largest image it holds (``image_limits.replica_limits``)."""
        import ray

        from raycluster_cli.diffusion.workers import Replica

        settings, name = self.settings, f"image-{uuid.uuid4().hex[:8]}"
        replicas = [
            Replica(settings.model_path, h, settings.num_threads, settings.dtype, f"{name}-{i}")
            for i, h in enumerate(holders)
        ]
        probe = ImageRequest(
            CALIBRATION_PROMPT, seed=0, steps=settings.steps, height=self.size, width=self.size,
            guidance=settings.guidance,
        )  # fmt: skip
        try:
            limit = placing.image_deadline_s(settings.steps)
            seconds = placing.calibrate(replicas, probe, settings.calibration_repeats, limit, lambda *a, **k: None)
            memory = ray.get([ref for r in replicas for ref in r.memory()], timeout=COUNTERS_S * 6)
        except BaseException:
            for replica in replicas:
                replica.kill()
            raise
        slots, measured = [], iter(memory)
        for i, (r, h, s) in enumerate(zip(replicas, holders, seconds, strict=True)):
            rows = [
                {"node_id": n, "node_ip": placed.ip_of.get(n, ""), "parts": parts, "actor": label}
                for (n, parts), label in zip(h, r.names, strict=True)
            ]
            slot = Slot(i, r, s, rows, lanes_of(r))
            mine = [next(measured) for _ in r.actors]
            slot.limits = image_limits.replica_limits(mine, placed.room_of, h, self.weights, self.size * self.size)
            slots.append(slot)
        return slots

    async def _regrow(self, lost: Slot) -> Slot | None:
        """A replica in place of ``lost``: placed on the alive nodes no live replica uses, timed; None when no
        such node holds one."""
        busy = {row["node_id"] for slot in self.pool.live() for row in slot.holders}
        placed = await asyncio.wait_for(asyncio.to_thread(_place, self.settings, self.size), REGROW_S)
        free = [h for h in placed.holders if not {node for node, _ in h} & busy]
        if not free:
            return None
        slots = await asyncio.wait_for(asyncio.to_thread(self._timed, free[:1], placed), REGROW_S)
        return slots[0]

    async def check_health(self) -> None:
        self.metrics.record("raycluster_serve_replicas_live", len(self.pool.live()), {"model": self.model_id})
        problem = self.pool.health()
        if problem is not None:
            raise RuntimeError(problem)

    def describe(self) -> dict[str, Any]:
        """The placement, for the launcher's document (called through the deployment handle)."""
        return {
            "why": self.why, "calibration": self.calibration, "dtype": self.settings.dtype,
            "pipelines": [s.to_json() | {"why": self.why} for s in self.pool.slots],
        }  # fmt: skip

    @image_api.get("/v1/models", dependencies=KEYED)
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [protocol.model_card(self.model_id, self.created)]}

    @image_api.get("/v1/models/{model:path}", dependencies=KEYED)
    async def model(self, model: str) -> dict[str, Any]:
        protocol.check_model(model, self.model_id)
        return protocol.model_card(self.model_id, self.created)

    @image_api.get("/health")
    async def health(self) -> dict[str, Any]:
        return protocol.health(len(self.pool.live()), RETRY_AFTER_S)

    @image_api.get("/raycluster/status", dependencies=KEYED)
    async def status(self) -> dict[str, Any]:
        body = {"model": self.model_id, "kind": "image", "why": self.why, **self.pool.status()}
        body["calibration"] = self.calibration
        actors = [a for s in self.pool.slots if s.state == "live" for a in s.replica.actors]
        try:
            body["nodes"] = list(
                await asyncio.wait_for(asyncio.gather(*(a.stats.remote() for a in actors)), COUNTERS_S)
            )
        except Exception as exc:
            body["counters_error"] = f"{type(exc).__name__}: {exc}"
        return body

    @image_api.post("/v1/images/generations", dependencies=KEYED)
    async def generations(self, request: Request) -> dict[str, Any]:
        body: ImageGenerationRequest = protocol.parse(ImageGenerationRequest, await request.body())
        if body.model is not None:
            protocol.check_model(body.model, self.model_id)
        limits = self.settings
        width, height = body.dimensions(self.size, MULTIPLE, image_limits.largest_side(limits.max_pixels, MULTIPLE))
        image_limits.check_pixels(width, height, limits.max_pixels)
        steps = body.num_inference_steps or self.settings.steps
        image_limits.check_steps(steps, limits.max_steps)
        image_limits.check_memory(width, height, self.pool.live())
        seed = body.seed if body.seed is not None else secrets.randbelow(2**31)
        guidance = self.settings.guidance if body.guidance_scale is None else body.guidance_scale
        requests = [
            ImageRequest(body.prompt, seed + i, steps, height, width, guidance, body.negative_prompt)
            for i in range(body.n)
        ]
        began, outcome = time.monotonic(), "error"
        try:
            made = await self.pool.images(requests)
            outcome = "ok"
        except ImagesWaitingFull as exc:
            outcome = "refused"
            raise APIError(503, f"the service is full ({exc}); retry later", retry_after=RETRY_AFTER_S) from None
        except NoReplica as exc:
            outcome = "refused"
            raise APIError(503, f"the service is not ready: {exc}", retry_after=RETRY_AFTER_S) from None
        except RayTaskError as exc:  # the generation itself raised (not a lost node): nothing to move
            first = str(exc.cause if exc.cause is not None else exc).strip().splitlines()
            raise APIError(500, f"the generation failed: {first[-1] if first else type(exc).__name__}") from None
        finally:
            image_request(self.metrics, self.model_id, outcome, len(requests), time.monotonic() - began)
        encoded = await asyncio.to_thread(lambda: [png_b64(image[0]) for image in made])  # off the event loop
        data = [
            {"b64_json": b64, "revised_prompt": None, "seed": r.seed} for b64, r in zip(encoded, requests, strict=True)
        ]
        return {"created": int(time.time()), "data": data, "output_format": "png", "size": f"{width}x{height}"}


def build_image_app(settings: ImageSettings, **options: Any) -> Any:
    """The application to ``serve.run``: ``options`` go to the deployment (ray_actor_options, health checks)."""
    deployment: Any = ImageServer
    return deployment.options(**options).bind(settings) if options else deployment.bind(settings)
