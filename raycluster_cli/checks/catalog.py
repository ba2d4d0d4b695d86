"""The preflight checks that `doctor` and `up` run on every host, in the order they are reported, and the
host facts they judge (each fact's command runs once per host, in the host's one batch of the verb)."""

from __future__ import annotations

from raycluster_cli.checks import access, hostnet, machine
from raycluster_cli.checks.base import Check, CheckContext
from raycluster_cli.checks.cross import CROSS_IDS, IMAGE_ID_CHECK
from raycluster_cli.host import folders
from raycluster_cli.host.engine_facts import CONTAINERS, ENGINE, IMAGE
from raycluster_cli.host.facts import derived, raw
from raycluster_cli.transport import quote
from raycluster_cli.transport.batch import BATCH_START

__all__ = ["ALL_CHECKS", "ALL_IDS", "IMAGE_ID_CHECK"]


def _head(ctx: CheckContext) -> bool:
    return ctx.host.role == "head"


def _worker(ctx: CheckContext) -> bool:
    return ctx.host.role == "worker"


def _not_root_default(ctx: CheckContext) -> bool:
    """Root with the default folder: Docker mounts /etc/raycluster, nothing to prove (and no container to run)."""
    return folders.state_root(ctx.inventory, ctx.host) != folders.ROOT_DEFAULT or (
        folders.login_user(ctx.inventory, ctx.host) != "root"
    )


def _wants_gpus(ctx: CheckContext) -> bool:
    return (ctx.host.num_gpus or 0) > 0


# The engine is read once per host (enginefacts: one `docker info`, one `docker image inspect`, one
# `docker ps -a`); the checks' facts that need it are derived from those readings on this machine.
DOCKER_VERSION = derived("docker-version", (ENGINE,), machine.docker_view)
IMAGE_ID = derived("image-id", (IMAGE,), machine.image_view)
IMAGE_RUNTIME = derived("image-runtime", (IMAGE,), machine.image_runtime_view)
IP_ADDR = raw("ip-addr", lambda ctx: "ip -o -4 addr show", quick=True)
ROUTE_TO_HEAD = raw("route-to-head", lambda ctx: "ip route get " + quote(ctx.inventory.head_address), quick=True)
PORTS = raw("ports", hostnet.ports_command, quick=True)
HEAD_PORTS = derived("head-ports", (PORTS, CONTAINERS), hostnet.head_ports_view)
WORKER_PORTS = derived("worker-ports", (PORTS, CONTAINERS), hostnet.worker_ports_view)
ETC_HOSTS = raw("etc-hosts", lambda ctx: hostnet.ETC_HOSTS_COMMAND, quick=True)
CLOCK = raw("clock", lambda ctx: f"echo {BATCH_START}", timed=True, quick=True)
MEMINFO = raw("meminfo", lambda ctx: "cat /proc/meminfo", quick=True)
DISK = derived("disk", (ENGINE, MEMINFO, IMAGE), machine.disk_view)
GPU_DEVICES = raw("gpu-devices", machine.gpus_command)
GPUS = derived("gpus", (GPU_DEVICES, ENGINE), machine.gpus_view)
PROCESSES = raw("processes", machine.processes_command)
STALE_RAY = derived("stale-ray", (PROCESSES, CONTAINERS), machine.stale_ray_view)
STATE_DIR = raw("state-dir", lambda ctx: folders.probe_command(ctx.inventory, ctx.host))
STATE_MOUNT = raw("state-mount", lambda ctx: folders.mount_command(ctx.inventory, ctx.host))

ALL_CHECKS: tuple[Check, ...] = (
    Check("docker", "Docker daemon", DOCKER_VERSION, machine.docker),
    Check("state-dir", "host state folder writable", STATE_DIR, access.state_dir),
    Check("state-mount", "state folder mountable", STATE_MOUNT, access.state_mount, _not_root_default),
    Check(IMAGE_ID_CHECK, "node image", IMAGE_ID, machine.image),
    Check("image-runtime", "Ray and Python in the image", IMAGE_RUNTIME, machine.image_runtime),
    Check("head-address", "head address on a NIC", IP_ADDR, hostnet.head_address, _head),
    Check("route-to-head", "source address towards the head", ROUTE_TO_HEAD, hostnet.route_to_head, _worker),
    Check("addresses", "global IPv4 addresses", IP_ADDR, hostnet.addresses),
    Check("ports-free", "Ray ports free on the head", HEAD_PORTS, hostnet.ports_free, _head),
    Check("worker-ports", "Ray worker port range", WORKER_PORTS, hostnet.worker_ports),
    Check("etc-hosts", "hostname in /etc/hosts", ETC_HOSTS, hostnet.etc_hosts),
    Check("clock", "clock skew", CLOCK, hostnet.clock),
    Check("shm", "/dev/shm for the object store", MEMINFO, machine.shm),
    Check("memory", "free memory", MEMINFO, machine.memory),
    Check("disk", "free disk", DISK, machine.disk),
    Check("gpus", "GPUs and the NVIDIA runtime", GPUS, machine.gpus, _wants_gpus),
    Check("stale-ray", "no other Ray on the host", STALE_RAY, machine.stale_ray),
)

ALL_IDS: frozenset[str] = frozenset({"ssh", *CROSS_IDS, *(c.id for c in ALL_CHECKS)})
