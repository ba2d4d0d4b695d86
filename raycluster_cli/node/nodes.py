"""The Ray nodes as this process sees them: which are alive, their addresses, CPUs, GPUs and memory room, the device a stage runs on."""

from __future__ import annotations

import ipaddress
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycluster_cli.models.cpu import cpu_flags
from raycluster_cli.node.cgroup import container_cpu_quota, node_capacity, torch_threads
from raycluster_cli.placement.memory import Capacity

# Idle OpenMP threads sleep instead of spinning: several stages may share a machine's cores (a lab on
# one host, other tenants), and spinning threads of one stage then steal the CPU of the next.
WORKER_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


UNIT_TYPES = ("embedding", "block", "head")


def _node_entry(node_id: str) -> dict[str, Any]:
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return dict(node)
    return {}


def node_ip(node_id: str) -> str:
    """The IP the node registered with (what the driver sorts by), else this process's own guess.

    ``ray.util.get_node_ip_address()`` inside a worker may pick the default-route interface
    rather than the ``--node-ip-address`` the node was started with, so the node table wins.
    """
    return str(_node_entry(node_id).get("NodeManagerAddress") or ray.util.get_node_ip_address())


def peak_rss() -> int:
    """This process's peak resident set (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def node_cpu_count(node_id: str) -> int:
    """Torch threads for ``node_id``: the container's CPU quota (else the CPUs Ray advertises), rounded
    up, capped by the usable cores."""
    advertised = float(_node_entry(node_id).get("Resources", {}).get("CPU", 0.0))
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return torch_threads(advertised, usable, container_cpu_quota())


BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 instructions that multiply bfloat16 natively


def native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 natively (``/proc/cpuinfo``'s flags, or ``cpuinfo``'s text): where it
    does not, torch emulates bfloat16 products in float32 and a bfloat16 model runs slower than a float32 one."""
    return not cpu_flags(cpuinfo).isdisjoint(BF16_FLAGS)


@ray.remote(num_cpus=0)
def _node_bf16() -> bool:
    return native_bf16()


def on_each(
    task: Any, node_ids: Sequence[str], timeout_s: float, arguments: Callable[[str], tuple[Any, ...]] = lambda n: ()
) -> list[Any]:
    """``task``'s answer from every node of ``node_ids``, each call pinned to its node (``arguments(node_id)`` its
    arguments), all at once, within ``timeout_s``."""
    calls = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n, soft=False)).remote(*arguments(n))
        for n in node_ids
    ]
    return list(ray.get(calls, timeout=timeout_s))


def all_native_bf16(node_ids: Sequence[str], timeout_s: float) -> bool:
    """Whether the CPU of every node in ``node_ids`` multiplies bfloat16 natively (one task on each)."""
    return bool(node_ids) and all(on_each(_node_bf16, node_ids, timeout_s))


@ray.remote(num_cpus=0)
def _node_room(node_id: str, device: str | None) -> dict[str, Any]:
    """This node's room, measured in a process that has torch loaded as a stage or part worker will."""
    return node_capacity(node_id, node_ip(node_id), device or pick_device()).to_dict()


def measure_rooms(node_ids: Sequence[str], timeout_s: float, device: str | None = None) -> list[Capacity]:
    """Each node's room (``cgroup.node_capacity`` on the node: its container's limit less what is in use, or its
    GPU's free memory where a stage would run on ``cuda``; ``device`` "cpu" for workers that stay on the CPU), all
    at once."""
    return [Capacity.from_dict(c) for c in on_each(_node_room, node_ids, timeout_s, lambda n: (n, device))]


def pick_device() -> str:
    """``cuda`` when this process sees a GPU (the driver asks Ray for one on GPU nodes), else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def gpu_shares(node_ids: Sequence[str], gpus: Mapping[str, float]) -> list[float]:
    """The part of a GPU each of these stages asks Ray for: nothing on a node without GPUs; a whole GPU each while
    a node has one per stage; else the stages on that node split its GPUs evenly in parts Ray can pack (1/2 each for
    3 stages on 2 GPUs: two on one, one on the other; asking 2/3 each, the third would never be placed)."""
    shares = []
    for node_id in node_ids:
        have = int(gpus.get(node_id, 0.0))
        if have < 1:
            shares.append(0.0)
            continue
        stacked = sum(1 for n in node_ids if n == node_id)
        shares.append(1.0 / math.ceil(stacked / have))
    return shares


def _ip_key(ip: str) -> tuple[int, Any]:
    try:
        return (0, ipaddress.ip_address(ip))
    except ValueError:
        return (1, ip)


def alive_nodes() -> list[dict[str, Any]]:
    """Alive Ray nodes as ``{"node_id", "node_ip", "gpus"}``, sorted by IP (then id)."""
    import ray

    nodes = [
        {
            "node_id": str(n["NodeID"]),
            "node_ip": str(n.get("NodeManagerAddress", "")),
            "gpus": float(n.get("Resources", {}).get("GPU", 0.0)),
        }
        for n in ray.nodes()
        if n.get("Alive")
    ]
    nodes.sort(key=lambda n: (_ip_key(str(n["node_ip"])), str(n["node_id"])))
    return nodes


def gpu_counts(nodes: list[dict[str, Any]]) -> dict[str, float]:
    """The GPUs of each node of ``alive_nodes()`` that has at least one whole GPU (the others left out)."""
    return {str(n["node_id"]): float(n["gpus"]) for n in nodes if n["gpus"] >= 1}


def node_gpus() -> dict[str, float]:
    """GPUs each alive Ray node offers (nodes without a whole GPU left out)."""
    return gpu_counts(alive_nodes())
