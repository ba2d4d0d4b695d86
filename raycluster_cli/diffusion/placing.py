"""Where a diffusers pipeline goes: each node's room, whole replicas where one node holds every part, parts apart where none does, and the seconds per image each replica measured."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raycluster_cli.diffusion.parts import PARTS, ImageRequest
from raycluster_cli.placement.memory import Capacity

log = logging.getLogger("raycluster.diffusion")
Report = Callable[..., None]


MIB = 1024 * 1024


WEIGHT_HEADROOM = 1.2  # loading copies and allocator slack over the weights themselves


WORKER_BYTES = 400 * MIB  # a part worker's own process, Python with torch and diffusers (360 MiB measured)
ACTIVATION_BYTES_512 = 768 * MIB  # a float32 generation's activations at 512 × 512 with guidance, scaled by area


class CutNeeded(ValueError):
    """No node holds the UNet: ``unet_place`` cuts it by blocks."""

    def __init__(self, needs: dict[str, int], rooms: str) -> None:
        super().__init__(
            f"the unet needs {needs['unet'] // MIB} MiB and no node has it (nodes: {rooms}); only `bench` cuts "
            "the UNet by blocks: add memory or nodes"
        )
        self.needs = needs


@dataclass(frozen=True)
class NodeRoom:
    node_id: str
    node_ip: str
    capacity: int  # bytes a part may take on that node: the least of Ray's `memory` and the container's room
    cpus: float | None = None  # its CPU quota (else Ray's CPU count): the UNet goes to the most CPU it fits
    source: str = "ray"  # where the room came from: "ray" (its `memory` resource), else the container's cgroup
    limit: int | None = None  # the container's memory limit
    container: int | None = None  # what the container alone can still give a part (Ray's `memory` aside)

    def describe(self) -> str:
        limit = f", limit {self.limit // MIB} MiB" if self.limit else ""
        cpus = f", {self.cpus:g} CPU" if self.cpus else ""
        return f"{self.node_ip} {self.capacity // MIB} MiB ({self.source}{limit}{cpus})"


Holders = list[tuple[str, list[str]]]  # (node id, parts) of one replica


def activation_bytes(size: int) -> int:
    return int(ACTIVATION_BYTES_512 * (size / 512) ** 2)


def place(nodes: list[NodeRoom], weights: dict[str, int], size: int) -> tuple[list[Holders], str]:
    """Replicas of the whole pipeline where it fits, else one replica of three stages; why, in words."""
    act = activation_bytes(size)
    need = {part: int(weights[part] * WEIGHT_HEADROOM) + (act if part == "unet" else act // 4) for part in PARTS}
    whole = int(sum(weights.values()) * WEIGHT_HEADROOM) + act
    fits = [n for n in nodes if n.capacity >= whole]
    if fits:
        why = (
            f"{len(fits)} of {len(nodes)} node(s) hold the whole pipeline ({whole // MIB} MiB with activations): "
            "a replica on each, requests in proportion to their measured speed"
        )
        return [[(n.node_id, list(PARTS))] for n in fits], why
    rooms = "; ".join(n.describe() for n in nodes)
    if not any(n.capacity >= need["unet"] for n in nodes):
        raise CutNeeded(need | {"act": act}, rooms)
    free = sorted(nodes, key=lambda n: (-(n.cpus or 0.0), -n.capacity))
    holders: Holders = []
    for part in ("unet", "text", "vae"):  # the largest part first, onto the fastest node left that holds it
        node = next((n for n in free if n.capacity >= need[part]), None)
        if node is None:
            raise ValueError(
                f"the {part} needs {need[part] // MIB} MiB and no node left has it (nodes: {rooms}); the whole "
                f"pipeline needs {whole // MIB} MiB: add memory or nodes"
            )
        free.remove(node)
        holders.append((node.node_id, [part]))
    where = ", ".join(f"{part} on {next(n.node_ip for n in nodes if n.node_id == h)}" for h, (part,) in holders)
    why = (
        f"no node holds the whole pipeline ({whole // MIB} MiB; nodes: {rooms}): its parts as stages, "
        f"text encoder | UNet | VAE decoder, the largest first onto the node with the most CPU it fits ({where})"
    )
    order = {part: i for i, part in enumerate(PARTS)}
    return [sorted(holders, key=lambda h: order[h[1][0]])], why


def node_rooms(timeout_s: float = 120.0) -> list[NodeRoom]:
    """The alive Ray nodes and the memory each offers a part (what ``place`` weighs): Ray's `memory` resource,
    or less where the node's container has less room left for a part's worker (``WORKER_BYTES`` and the part)."""
    import ray

    from raycluster_cli.node.nodes import measure_rooms

    alive = [n for n in ray.nodes() if n.get("Alive")]
    found = measure_rooms([str(n["NodeID"]) for n in alive], timeout_s, device="cpu")  # the parts run on CPUs
    return sorted((room_of(n, c) for n, c in zip(alive, found, strict=True)), key=lambda n: (n.node_ip, n.node_id))


def room_of(node: dict[str, Any], container: Capacity) -> NodeRoom:
    """One node's room from its ``ray.nodes()`` entry and what its container said (``cgroup.node_capacity``)."""
    resources = node.get("Resources", {})
    logical = int(resources.get("memory", 0))
    physical = max(0, container.usable - WORKER_BYTES)
    source = "ray" if logical <= physical else container.source
    cpus = container.cpu_quota or float(resources.get("CPU", 0.0)) or None
    ip = str(node.get("NodeManagerAddress", ""))
    return NodeRoom(str(node["NodeID"]), ip, min(logical, physical), cpus, source, container.limit, physical)


STEP_TIMEOUT_S = 30.0  # a denoising step's share of an image's deadline is a quarter of this (bench's --step-timeout-s)


def image_deadline_s(steps: int, seconds: float | None = None, step_timeout_s: float = STEP_TIMEOUT_S) -> float:
    """How long one image may take before its replica counts as lost: 20× its calibrated ``seconds``, at least a
    quarter of the step timeout per denoising step; before any calibration, at least 600 s."""
    least = step_timeout_s * max(1, steps) / 4
    return max(least, 20 * seconds) if seconds else max(least, 600.0)


def calibrate(replicas: list[Any], probe: ImageRequest, repeats: int, limit: float, progress: Report) -> list[float]:
    """Seconds per image on each replica: one warm-up ``probe``, then the median of ``repeats``, all replicas at
    once (as they run in the counted run), each timed from its submission to its image, within ``limit`` s."""
    import ray

    progress("calibration: one image per replica")
    ray.get([r.submit(probe) for r in replicas], timeout=limit)
    times: list[list[float]] = [[] for _ in replicas]
    for _ in range(repeats):
        began = time.perf_counter()
        refs = {r.submit(probe): index for index, r in enumerate(replicas)}
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1, timeout=limit)
            if not done:
                raise TimeoutError(f"no calibration image within {limit:.0f} s: a node stopped")
            times[refs.pop(done[0])].append(time.perf_counter() - began)
    return [statistics.median(t) for t in times]
