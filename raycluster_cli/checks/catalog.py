"""The preflight checks that `doctor` and `up` run on every host, in the order they are reported."""

from __future__ import annotations

from ..transport import quote
from . import hostnet, runtime
from .base import Check, CheckContext
from .cross import CROSS_IDS, IMAGE_ID_CHECK

__all__ = ["ALL_CHECKS", "ALL_IDS", "IMAGE_ID_CHECK"]


def _head(ctx: CheckContext) -> bool:
    return ctx.host.role == "head"


def _worker(ctx: CheckContext) -> bool:
    return ctx.host.role == "worker"


def _wants_gpus(ctx: CheckContext) -> bool:
    return (ctx.host.num_gpus or 0) > 0


ALL_CHECKS: tuple[Check, ...] = (
    Check("docker", "Docker daemon", lambda ctx: "docker info --format '{{.ServerVersion}}'", runtime.docker),
    Check(
        IMAGE_ID_CHECK,
        "node image",
        lambda ctx: "docker image inspect --format '{{.Id}}' " + quote(ctx.inventory.image),
        runtime.image,
    ),
    Check("image-runtime", "Ray and Python in the image", runtime.versions_command, runtime.image_runtime),
    Check("head-address", "head address on a NIC", lambda ctx: "ip -o -4 addr show", hostnet.head_address, _head),
    Check(
        "route-to-head",
        "source address towards the head",
        lambda ctx: "ip route get " + quote(ctx.inventory.head_address),
        hostnet.route_to_head,
        _worker,
    ),
    Check("addresses", "global IPv4 addresses", lambda ctx: "ip -o -4 addr show", hostnet.addresses),
    Check("ports-free", "Ray ports free on the head", hostnet.ports_command, hostnet.ports_free, _head),
    Check("worker-ports", "Ray worker port range", hostnet.worker_ports_command, hostnet.worker_ports),
    Check("etc-hosts", "hostname in /etc/hosts", lambda ctx: "hostname; echo ---; cat /etc/hosts", hostnet.etc_hosts),
    Check("clock", "clock skew", lambda ctx: "date +%s.%N", hostnet.clock, timed=True),
    Check("shm", "/dev/shm for the object store", lambda ctx: "cat /proc/meminfo", runtime.shm),
    Check("memory", "free memory", lambda ctx: "cat /proc/meminfo", runtime.memory),
    Check("disk", "free disk", runtime.disk_command, runtime.disk),
    Check("gpus", "GPUs and the NVIDIA runtime", runtime.gpus_command, runtime.gpus, _wants_gpus),
    Check("stale-ray", "no other Ray on the host", runtime.stale_ray_command, runtime.stale_ray),
)

ALL_IDS: frozenset[str] = frozenset({"ssh", *CROSS_IDS, *(c.id for c in ALL_CHECKS)})
