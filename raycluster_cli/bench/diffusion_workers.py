"""Ray actors holding parts of a diffusers checkpoint, one per node (or one per part), timing their compute.

A replica is the actors that together hold ``text``, ``unet`` and ``vae``: one actor with all three on a node that
holds the whole pipeline, else one actor per part on its own node.  ``generate`` chains the steps through Ray's
object store (each step's output goes from its actor to the next actor, not through the driver).
``reference_image`` runs diffusers' own pipeline
one part per task, each on a node the placement gave room for it, so checking an image never needs a node (or the
driver's) room for the whole pipeline.
"""

from __future__ import annotations

import time
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycluster_cli.bench.cgroup import container_memory
from raycluster_cli.bench.diffusion import PARTS, Components, ImageRequest, reference_step
from raycluster_cli.bench.pipeline import node_cpu_count, node_ip, peak_rss


class _DiffusionWorker:
    def __init__(self, path: str, parts: list[str], num_threads: int | None = None, dtype: str = "float32") -> None:
        self.node_id: str = ray.get_runtime_context().get_node_id()
        self.node_ip = node_ip(self.node_id)
        self.num_threads = num_threads or node_cpu_count(self.node_id)
        torch.set_num_threads(self.num_threads)
        self.components = Components(path, tuple(parts), getattr(torch, dtype))
        self.reset_stats()

    def reset_stats(self) -> None:
        self.busy_s, self.calls = 0.0, 0

    def _timed(self, work: Any) -> Any:
        began = time.perf_counter()
        try:
            return work()
        finally:
            self.busy_s += time.perf_counter() - began
            self.calls += 1

    def encode(self, request: ImageRequest) -> torch.Tensor:
        return self._timed(lambda: self.components.encode(request))

    def denoise(self, embeddings: torch.Tensor, request: ImageRequest) -> torch.Tensor:
        return self._timed(lambda: self.components.denoise(embeddings, request))

    def decode(self, latents: torch.Tensor) -> Any:
        return self._timed(lambda: self.components.decode(latents))

    def generate(self, request: ImageRequest) -> Any:
        return self._timed(lambda: self.components.generate(request))

    def info(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "parts": list(self.components.parts),
            "num_threads": self.num_threads,
            "weight_bytes": self.components.weight_bytes(),
            "load_s": round(self.components.load_s, 3),
            "dtype": str(self.components.dtype).removeprefix("torch."),
        }

    def stats(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "parts": list(self.components.parts),
            "busy_s": self.busy_s,
            "calls": self.calls,
            "memory": container_memory(),  # the container's, after the run: working set, peak, OOM kills
            "process_peak_rss_bytes": peak_rss(),
        }


DiffusionWorker = ray.remote(num_cpus=0)(_DiffusionWorker)


def _on(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


@ray.remote(num_cpus=0)
def _reference(path: str, part: str, request: ImageRequest, given: Any) -> Any:
    return reference_step(path, part, request, given)


def reference_image(path: str, request: ImageRequest, where: dict[str, str], timeout_s: float) -> Any:
    """diffusers' own image for ``request``: each part's step (``diffusion.reference_step``) a task on the node
    ``where`` names for it, the output of one handed to the next through the object store."""
    given: Any = None
    for part in PARTS:
        given = _reference.options(scheduling_strategy=_on(where[part])).remote(path, part, request, given)
    return ray.get(given, timeout=timeout_s)


class Replica:
    """The actors of one replica, by part; ``submit`` starts one request through them and returns its image's ref."""

    def __init__(
        self, path: str, holders: list[tuple[str, list[str]]], num_threads: int | None = None, dtype: str = "float32"
    ) -> None:
        self.actors: list[Any] = [
            DiffusionWorker.options(scheduling_strategy=_on(node_id)).remote(path, parts, num_threads, dtype)
            for node_id, parts in holders
        ]
        self.holders = holders
        self.by_part = {part: actor for actor, (_, parts) in zip(self.actors, holders, strict=True) for part in parts}
        missing = set(PARTS) - set(self.by_part)
        if missing:
            raise ValueError(f"a replica needs every part: {sorted(missing)} held by no actor")

    @property
    def whole(self) -> bool:
        return len(self.actors) == 1

    def submit(self, request: ImageRequest) -> Any:
        if self.whole:
            return self.actors[0].generate.remote(request)
        embeddings = self.by_part["text"].encode.remote(request)
        latents = self.by_part["unet"].denoise.remote(embeddings, request)
        return self.by_part["vae"].decode.remote(latents)

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
