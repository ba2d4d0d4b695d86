"""Ray actors of a UNet cut by blocks: a probe that times each unit on its node, the stage workers, and the
conductor that walks one image through the cut, step by step.

``UNetProbe`` loads the UNet one unit at a time (never more than one unit's weights in memory, so it runs on a node
that cannot hold the UNet) and times each on the real carry the units before it made, with the request's shape;
it also times the carry through Ray's serialiser (``ray.put`` on the sending side, ``ray.get`` on the receiving
side), which is what a cut costs each end besides the network.  CPU time is read with the wall clock so that
``balance.capacity_time`` can charge a node under a CPU quota what its work costs it, as the text split does.

The last stage owns the denoising loop's state (the request's generator, its scheduler and latents): it turns the
noise prediction into the next step's scaled model input, as ``Components.denoise`` does in one process.  Ray runs
one caller's calls to an actor in the order they were submitted, even when a later one's inputs are ready first,
so the steps of an image cannot all be chained at once without holding every other image behind them: the
conductor (an async actor) submits one step's chain through the stages at a time for each image, and the images
in flight fill the stages in turn.
"""

from __future__ import annotations

import functools
import gc
import inspect
import time
import uuid
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycluster_cli.diffusion.parts import Components, ImageRequest, _scheduler_class, vae_scale_factor
from raycluster_cli.diffusion.unet_cut import UNetStage, unit_names
from raycluster_cli.diffusion.workers import DiffusionWorker
from raycluster_cli.node.cgroup import container_cpu_quota
from raycluster_cli.node.nodes import node_cpu_count, node_ip
from raycluster_cli.placement import balance

Stage = tuple[str, int, int]  # (node id, first unit, end unit)


def _pinned(actor: Any, node_id: str) -> Any:
    return actor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False))


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


class _UNetProbe:
    def __init__(self, num_threads: int | None = None) -> None:
        self.node_id: str = ray.get_runtime_context().get_node_id()
        self.num_threads = num_threads or node_cpu_count(self.node_id)
        torch.set_num_threads(self.num_threads)

    def _time(self, work: Any, repeats: int) -> tuple[Any, float, float]:
        out = work()  # warm-up
        wall0, cpu0 = _clock()
        for _ in range(repeats):
            out = work()
        wall1, cpu1 = _clock()
        return out, (wall1 - wall0) / repeats, (cpu1 - cpu0) / repeats

    @torch.no_grad()
    def measure(self, path: str, request: ImageRequest, fits: list[bool], repeats: int = 2) -> dict[str, Any]:
        """Seconds (wall and CPU) of the text encoder, the VAE decoder and each UNet unit for one call of
        ``request``'s shape, and of the carry's serialisation at each cut; a unit ``fits`` marks too big is
        not loaded (its cost None)."""
        text = Components(path, ("text",))
        context, text_wall, text_cpu = self._time(functools.partial(text.encode, request), repeats)
        del text
        vae = Components(path, ("vae",))
        latents_shape = (request.n, 4, request.height // vae.scale_factor, request.width // vae.scale_factor)
        latents = torch.randn(latents_shape, generator=torch.Generator().manual_seed(0))
        _, vae_wall, vae_cpu = self._time(functools.partial(vae.decode, latents), repeats)
        del vae
        batch = context.shape[0]
        x: Any = torch.randn((batch, *latents_shape[1:]), generator=torch.Generator().manual_seed(1))
        t = torch.tensor(500)
        names = unit_names(UNetStage.on_meta(path, 0, 1).config)
        units: list[dict[str, Any] | None] = []
        for index in range(len(names)):
            if not fits[index]:
                units.append(None)
                x = None
                continue
            if x is None:  # a unit before this one could not be loaded here: nothing to feed this one
                units.append(None)
                continue
            stage = UNetStage(path, index, index + 1)
            x_in = x
            x, wall, cpu = self._time(lambda s=stage, v=x_in: s.forward(v, t, context), repeats)
            row: dict[str, Any] = {"wall_s": wall, "cpu_s": cpu}
            if index < len(names) - 1:
                ref = ray.put(x)  # the sending side's serialisation, then the receiving side's
                w0, c0 = _clock()
                ref = ray.put(x)
                w1, c1 = _clock()
                ray.get(ref)
                w2, c2 = _clock()
                row |= {"put_wall_s": w1 - w0, "put_cpu_s": c1 - c0, "get_wall_s": w2 - w1, "get_cpu_s": c2 - c1}
            units.append(row)
            del stage
            gc.collect()
        return {
            "node_id": self.node_id,
            "num_threads": self.num_threads,
            "cpu_quota": container_cpu_quota(),
            "text": {"wall_s": text_wall, "cpu_s": text_cpu},
            "vae": {"wall_s": vae_wall, "cpu_s": vae_cpu},
            "units": units,
        }


UNetProbe = ray.remote(num_cpus=0)(_UNetProbe)


class _UNetStageWorker:
    def __init__(self, path: str, start: int, end: int, num_threads: int | None = None, dtype: str = "float32"):
        self.node_id: str = ray.get_runtime_context().get_node_id()
        self.node_ip = node_ip(self.node_id)
        self.num_threads = num_threads or node_cpu_count(self.node_id)
        torch.set_num_threads(self.num_threads)
        began = time.monotonic()
        self.stage = UNetStage(path, start, end, getattr(torch, dtype))
        self.load_s = time.monotonic() - began
        self.last = end == len(self.stage.names)
        self.label = "unet[" + ",".join(self.stage.held) + "]"
        self.scheduler_class = _scheduler_class(Path(path)) if self.last else None
        self.path = path
        self.jobs: dict[str, dict[str, Any]] = {}  # the images in flight through this (last) stage, by key
        self.reset_stats()

    def reset_stats(self) -> None:
        self.busy_s, self.calls = 0.0, 0
        self.since, self.cpu_since = time.perf_counter(), time.process_time()
        self.spans: list[tuple[float, float]] = []  # each call's (start, end), seconds after the reset

    @torch.no_grad()
    def begin(self, request: ImageRequest, key: str) -> tuple[torch.Tensor, list[Any]]:
        """The last stage: the request's seeded noise and scheduler (as ``Components.denoise``); the first
        step's model input and the timesteps."""
        from diffusers.utils.torch_utils import randn_tensor

        assert self.scheduler_class is not None, "begin runs on the UNet's last stage"
        scheduler = self.scheduler_class.from_pretrained(f"{self.path}/scheduler")
        generator = torch.Generator().manual_seed(request.seed)
        factor = vae_scale_factor(self.path)
        shape = (request.n, self.stage.config["in_channels"], request.height // factor, request.width // factor)
        scheduler.set_timesteps(request.steps)
        latents = randn_tensor(shape, generator=generator, dtype=self.stage.dtype) * scheduler.init_noise_sigma
        accepted = set(inspect.signature(scheduler.step).parameters)
        extra = {k: v for k, v in (("eta", 0.0), ("generator", generator)) if k in accepted}
        timesteps = list(scheduler.timesteps)
        job = {"scheduler": scheduler, "latents": latents, "extra": extra, "request": request, "timesteps": timesteps}
        job["step"] = 0
        self.jobs[key] = job
        return self._model_input(job, timesteps[0]), timesteps

    def _model_input(self, job: dict[str, Any], t: Any) -> torch.Tensor:
        latents = job["latents"]
        model_input = torch.cat([latents] * 2) if job["request"].guidance > 1.0 else latents
        out: torch.Tensor = job["scheduler"].scale_model_input(model_input, t)
        return out

    @torch.no_grad()
    def forward(self, x: Any, t: Any, context: torch.Tensor, key: str) -> Any:
        """This stage's units; on the last stage also guidance and the scheduler's step: the next step's model
        input, or after the last step the latents."""
        began = time.perf_counter()
        try:
            out = self.stage.forward(x, t, context.to(self.stage.dtype))
            if not self.last:
                return out
            assert isinstance(out, torch.Tensor)
            job = self.jobs[key]
            request: ImageRequest = job["request"]
            if request.guidance > 1.0:
                uncond, text = out.chunk(2)
                out = uncond + request.guidance * (text - uncond)
            job["latents"] = job["scheduler"].step(out, t, job["latents"], **job["extra"], return_dict=False)[0]
            job["step"] += 1
            if job["step"] == len(job["timesteps"]):
                return self.jobs.pop(key)["latents"]
            return self._model_input(job, job["timesteps"][job["step"]])
        finally:
            ended = time.perf_counter()
            self.busy_s += ended - began
            self.calls += 1
            self.spans.append((began - self.since, ended - self.since))

    def info(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "parts": [self.label],
            "num_threads": self.num_threads,
            "weight_bytes": self.stage.weight_bytes(),
            "load_s": round(self.load_s, 3),
            "dtype": str(self.stage.dtype).removeprefix("torch."),
        }

    def stats(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "parts": [self.label],
            "busy_s": self.busy_s,
            "calls": self.calls,
            # where the stage's time went (the ceiling's measured cause): all of the process's CPU since the
            # reset (its forward passes and Ray's per-call work in it), and its idle time before its first call,
            # between calls (waiting for work) and after its last, up to now
            "cpu_s": time.process_time() - self.cpu_since,
            **balance.idle_breakdown(self.spans, time.perf_counter() - self.since),
        }


UNetStageWorker = ray.remote(num_cpus=0)(_UNetStageWorker)


@ray.remote(num_cpus=0)
class Conductor:
    """Walks each image through text encoder, the UNet's stages once per step, and the VAE decoder."""

    def __init__(self, text: Any, stages: list[Any], vae: Any) -> None:
        self.text, self.stages, self.vae = text, stages, vae

    async def generate(self, request: ImageRequest) -> Any:
        key = uuid.uuid4().hex
        context = self.text.encode.remote(request)
        x, timesteps = await self.stages[-1].begin.remote(request, key)
        for t in timesteps:
            for stage in self.stages:
                x = stage.forward.remote(x, t, context, key)
            x = await x
        return await self.vae.decode.remote(x)


class CutReplica:
    """One replica whose UNet is cut: text encoder, the UNet's stages and VAE decoder, each an actor on its node;
    ``submit`` as ``diffusion_workers.Replica``'s."""

    def __init__(
        self, path: str, text_node: str, stages: list[Stage], vae_node: str, num_threads: int | None = None
    ) -> None:
        self.text = _pinned(DiffusionWorker, text_node).remote(path, ["text"], num_threads)
        self.stages = [_pinned(UNetStageWorker, n).remote(path, a, b, num_threads) for n, a, b in stages]
        self.vae = _pinned(DiffusionWorker, vae_node).remote(path, ["vae"], num_threads)
        self.actors: list[Any] = [self.text, *self.stages, self.vae]
        here = ray.get_runtime_context().get_node_id()
        self.conductor = _pinned(Conductor, here).remote(self.text, self.stages, self.vae)
        names = unit_names(UNetStage.on_meta(path, 0, 1).config)
        self.holders = [
            (text_node, ["text"]),
            *[(n, ["unet[" + ",".join(names[a:b]) + "]"]) for n, a, b in stages],
            (vae_node, ["vae"]),
        ]

    whole = False

    @property
    def depth(self) -> int:
        """Images in flight: each image waits at every step for its own round trip through the stages and the
        conductor, so one image per actor leaves a stage idle while the others' hops run; twice that covers them
        (the first lab run, one per actor: 0.66 of the ceiling)."""
        return 2 * len(self.actors)

    def submit(self, request: ImageRequest) -> Any:
        return self.conductor.generate.remote(request)

    def kill(self) -> None:
        for actor in [*self.actors, self.conductor]:
            ray.kill(actor)
