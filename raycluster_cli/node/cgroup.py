"""This process's container as its cgroup (v2, else v1) describes it: CPU quota and usage, memory limit and use."""

from __future__ import annotations

import math
import os
from typing import Any

from raycluster_cli.placement.memory import Capacity, cgroup_capacity, margin


def read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def container_cpu_quota() -> float | None:
    """This process's CFS CPU quota in CPUs (cgroup v2, else v1), None when unlimited."""
    v2 = read("/sys/fs/cgroup/cpu.max")
    if v2 is not None:
        return cpu_quota(cpu_max=v2)
    return cpu_quota(
        cfs_quota_us=read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
        cfs_period_us=read("/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
    )


def container_cpu_usage() -> float | None:
    """CPU seconds this process's container (cgroup) has used, all its processes together; None if unknown."""
    v2 = read("/sys/fs/cgroup/cpu.stat")
    if v2 is not None:
        return cgroup_cpu_usage_s(cpu_stat=v2)
    return cgroup_cpu_usage_s(cpuacct_usage=read("/sys/fs/cgroup/cpuacct/cpuacct.usage"))


def oom_kills(events_text: str | None) -> int | None:
    """The kernel's OOM-kill count in a cgroup's ``memory.events`` (v2) or ``memory.oom_control`` (v1)."""
    for line in (events_text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def container_memory() -> dict[str, Any]:
    """The container's memory limit, working set (without droppable page cache) and peak usage, in bytes, and
    how many processes the kernel killed in it for memory (None where the cgroup does not say)."""
    for base, limit, usage, peak, events in (
        ("/sys/fs/cgroup/", "memory.max", "memory.current", "memory.peak", "memory.events"),
        (
            "/sys/fs/cgroup/memory/",
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
            "memory.max_usage_in_bytes",
            "memory.oom_control",
        ),
    ):
        usage_text = read(base + usage)
        if usage_text is None:
            continue
        found = cgroup_capacity(read(base + limit), usage_text, read(base + "memory.stat"))
        peak_text = read(base + peak)
        return {
            "limit_bytes": found[0] if found else None,
            "working_set_bytes": found[1] if found else int(usage_text),
            "peak_bytes": int(peak_text) if peak_text and peak_text.strip().isdigit() else None,
            "oom_kills": oom_kills(read(base + events)),
        }
    return {"limit_bytes": None, "working_set_bytes": None, "peak_bytes": None, "oom_kills": None}


def ray_memory_threshold() -> float:
    """The share of the memory limit above which Ray's memory monitor kills workers (0.95 unless set)."""
    try:
        return min(1.0, float(os.environ.get("RAY_memory_usage_threshold", "0.95")))  # noqa: SIM112  (Ray's spelling)
    except ValueError:
        return 0.95


def node_capacity(node_id: str, node_ip: str, device: str = "cpu") -> Capacity:
    """This process's node: the GPU's free memory on ``cuda``, else its container's room (cgroup), else the host's;
    with its container's CPU quota."""
    quota = container_cpu_quota()
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info()
        return Capacity(node_id, node_ip, max(0, free - margin(total)), total, total - free, "cuda", quota)
    import psutil

    host = psutil.virtual_memory()
    for source, base, limit_file, usage_file in (
        ("cgroup v2", "/sys/fs/cgroup/", "memory.max", "memory.current"),
        ("cgroup v1", "/sys/fs/cgroup/memory/", "memory.limit_in_bytes", "memory.usage_in_bytes"),
    ):
        found = cgroup_capacity(read(base + limit_file), read(base + usage_file), read(base + "memory.stat"))
        if found is not None:
            limit, used = found
            room = min(int(limit * ray_memory_threshold()) - used, int(host.available))
            return Capacity(node_id, node_ip, max(0, room - margin(limit)), limit, used, source, quota)
    available = int(host.available)
    used = int(host.total - available)
    return Capacity(node_id, node_ip, max(0, available - margin(available)), None, used, "host", quota)


def torch_threads(advertised_cpus: float, usable_cores: int, quota_cpus: float | None = None) -> int:
    """Threads for a stage: the node's CPUs, rounded up, never more than the usable cores.

    ``quota_cpus`` (the container's CFS quota, ``cpu_quota``) wins over what Ray advertises: Ray
    truncates a fractional quota (``--cpus=0.25`` or ``0.6`` advertise 0 CPUs), and a quota below
    one core is one thread, not every core of the machine (two threads burn the quota twice as fast
    and then both stall for the rest of the scheduler period).  Nothing known: the usable cores.
    """
    usable = max(1, usable_cores)
    cpus = quota_cpus if quota_cpus is not None and quota_cpus > 0 else advertised_cpus
    if cpus <= 0:
        return usable
    return max(1, min(math.ceil(cpus - 1e-9), usable))


def cpu_quota(
    cpu_max: str | None = None, cfs_quota_us: str | None = None, cfs_period_us: str | None = None
) -> float | None:
    """CPUs a cgroup's CFS quota allows (``0.25`` for ``--cpus=0.25``), or None when unlimited/unknown.

    ``cpu_max`` is the text of cgroup v2 ``cpu.max`` (``"25000 100000"`` or ``"max 100000"``); the
    v1 files ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` are used when it is not given.
    """
    try:
        if cpu_max is not None:
            quota, period = cpu_max.split()[:2]
            if quota == "max":
                return None
            value = float(quota) / float(period)
        elif cfs_quota_us is not None and cfs_period_us is not None:
            value = float(cfs_quota_us) / float(cfs_period_us)
        else:
            return None
    except (ValueError, ZeroDivisionError):
        return None
    return value if value > 0 else None


def cgroup_cpu_usage_s(cpu_stat: str | None = None, cpuacct_usage: str | None = None) -> float | None:
    """CPU seconds a cgroup has used: ``usage_usec`` of cgroup v2 ``cpu.stat``, else v1 ``cpuacct.usage`` (ns)."""
    try:
        if cpu_stat is not None:
            for line in cpu_stat.splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return float(value) / 1e6
            return None
        if cpuacct_usage is not None:
            return float(cpuacct_usage) / 1e9
    except ValueError:
        return None
    return None
