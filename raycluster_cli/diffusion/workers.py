"""Ray actors holding parts of a diffusers checkpoint, one per node (or one per part), timing their compute.

A replica is the actors that together hold ``text``, ``unet`` and ``vae``: one actor with all three on a node that
holds the whole pipeline, else one actor per part on its own node.  ``generate`` chains the steps through Ray's
object store (each step's output goes from its actor to the next actor, not through the driver).
``reference_image`` runs diffusers' own pipeline
one part per task, each on a node the placement gave room for it, so checking an image never needs a node (or the
driver's) room for the whole pipeline.

Each worker answers ``ping`` on a thread of its own (beside a generation on the default one), so the router can
tell a busy replica from a lost one, and ``memory`` says what its generations took beyond the loaded weights (the
process's peak resident set since loading, measured by resetting the kernel's high-water mark once loaded), so the
service can tell what a larger image needs before admitting it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycluster_cli.diffusion.parts import PARTS, Components, ImageRequest, reference_step
from raycluster_cli.node.cgroup import container_memory
from raycluster_cli.node.nodes import node_cpu_count, node_ip, peak_rss


class _DiffusionWorker:
    def __init__(self, path: str, parts: list[str], num_threads: int | None = None, dtype: str = "float32") -> None:
        self.node_id: str = ray.get_runtime_context().get_node_id()
        self.node_ip = node_ip(self.node_id)
        self.num_threads = num_threads or node_cpu_count(self.node_id)
        torch.set_num_threads(self.num_threads)
        self.components = Components(path, tuple(parts), getattr(torch, dtype))
        self.reset_stats()
        self.peak_reset = _reset_peak()  # the loading's copies are not the generations' memory
        self.loaded_rss = _vm("VmRSS")

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

    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        """This process's pid, answered on a thread of its own while a generation runs on the default one."""
        return os.getpid()

    @ray.method(concurrency_group="health")
    def memory(self) -> dict[str, Any]:
        """Bytes this process's generations took beyond the loaded weights (its peak since loading), or None where
        the peak could not be reset after loading (it would count the loading's copies)."""
        peak = _vm("VmHWM")
        work = peak - self.loaded_rss if self.peak_reset and peak and self.loaded_rss else None
        return {"parts": list(self.components.parts), "work_bytes": work, "peak_rss_bytes": peak}

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


def _reset_peak() -> bool:
    """Reset this process's peak resident set (VmHWM) to its current one (Linux, ``clear_refs`` 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _vm(field: str) -> int | None:
    """A ``/proc/self/status`` memory field in bytes (VmRSS, VmHWM), None where there is none."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


# generations on the default thread, one at a time; ``ping`` and ``memory`` on a thread of their own
DiffusionWorker = ray.remote(num_cpus=0, concurrency_groups={"health": 1})(_DiffusionWorker)  # type: ignore[call-overload]


NAMESPACE = "raycluster-images"  # the service's named replica actors


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
        self,
        path: str,
        holders: list[tuple[str, list[str]]],
        num_threads: int | None = None,
        dtype: str = "float32",
        name: str | None = None,
    ) -> None:
        """``name``: the actors are named ``{name}-{i}`` in ``NAMESPACE`` (the service names them, so an operator
        finds them); None: unnamed (``bench``)."""
        self.names = [f"{name}-{i}" for i in range(len(holders))] if name else [None] * len(holders)
        self.actors: list[Any] = [
            DiffusionWorker.options(
                scheduling_strategy=_on(node_id), name=label, namespace=NAMESPACE if label else None
            ).remote(path, parts, num_threads, dtype)
            for (node_id, parts), label in zip(holders, self.names, strict=True)
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

    def ping(self) -> list[Any]:
        """Each actor's ping (answered beside a generation): all answer while the replica is alive."""
        return [actor.ping.remote() for actor in self.actors]

    def memory(self) -> list[Any]:
        return [actor.memory.remote() for actor in self.actors]

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
