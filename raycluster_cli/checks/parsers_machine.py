"""Pure parsers for the runtime checks (memory, disk, GPUs, Docker, Ray processes), tested from recorded output."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def parse_docker_size(text: str) -> int | None:
    """Bytes of a Docker size such as `2g`, `512m`, `1.5g` (Docker's units are powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([bkmg]?)b?\s*", text.lower())
    if not match:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def gib(size: float) -> str:
    return f"{size / 1024**3:.1f} GiB"


def parse_meminfo(text: str) -> dict[str, int]:
    """`/proc/meminfo` → field → bytes."""
    found = {}
    for line in text.splitlines():
        match = re.match(r"^(\w+):\s+(\d+)(?:\s+kB)?", line)
        if match:
            found[match.group(1)] = int(match.group(2)) * (1024 if line.rstrip().endswith("kB") else 1)
    return found


@dataclass(frozen=True)
class DiskFree:
    path: str
    mount: str
    available: int


def parse_df(text: str, paths: list[str]) -> list[DiskFree]:
    """`df -P -B1 PATH...` (one line per path after the header; long device names may wrap)."""
    fields = " ".join(line for line in text.splitlines()[1:]).split()
    rows: list[DiskFree] = []
    # Each row is: filesystem, size, used, available, capacity, mounted-on.
    while len(fields) >= 6 and len(rows) < len(paths):
        chunk, fields = fields[:6], fields[6:]
        if chunk[3].isdigit():
            rows.append(DiskFree(paths[len(rows)], chunk[5], int(chunk[3])))
    return rows


@dataclass(frozen=True)
class Gpu:
    index: str
    name: str
    memory: str


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """`nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader`."""
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0].isdigit():
            gpus.append(Gpu(parts[0], parts[1], parts[2]))
    return gpus


def parse_runtimes(text: str) -> set[str]:
    """Runtime names from `docker info --format '{{json .Runtimes}}'` (an object keyed by name)."""
    try:
        value = json.loads(text.strip() or "{}")
    except ValueError:
        return set(re.findall(r"\b(nvidia|runc|io\.containerd\.runc\.v2|crun)\b", text))
    return set(value) if isinstance(value, dict) else set()


def parse_versions(text: str) -> dict[str, str]:
    """Lines `python 3.11.2` / `ray 2.60.0` printed inside the image."""
    found = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in ("python", "ray"):
            found[parts[0]] = parts[1]
    return found


@dataclass(frozen=True)
class RayProcess:
    pid: int
    command: str
    container_id: str  # "" for a process of the host itself
    container_name: str
    container_cluster: str  # the container's io.raycluster.cluster label ("" when none)


_RAY_PROCESS = re.compile(r"(^|/)(raylet|gcs_server)(\s|$)|^ray::")


def is_ray_process(args: str) -> bool:
    head = args.split(" ", 1)[0]
    return bool(_RAY_PROCESS.search(head)) or args.startswith("ray::")


def parse_ray_processes(ps_text: str, tops_text: str, cgroups_text: str = "") -> list[RayProcess]:
    """Ray processes from `ps -eo pid=,args=`, each placed in its container.

    `tops_text` has, per running container, a line `== <id> <name> <cluster-label>` followed by the host PIDs
    that `docker top <id> -eo pid` lists (the header line already removed). `cgroups_text` (optional) has a line
    `<pid> <its /proc/<pid>/cgroup on one line>` or `<pid> gone` per Ray process, read after the rest: a process
    that is gone is dropped (a short-lived worker), and one that `docker top` missed is placed by its cgroup.
    """
    owner: dict[int, tuple[str, str, str]] = {}
    containers: dict[str, tuple[str, str, str]] = {}
    current: tuple[str, str, str] | None = None
    for line in tops_text.splitlines():
        if line.startswith("== "):
            parts = line[3:].split()
            label = parts[2] if len(parts) > 2 and parts[2] != "<no" else ""
            current = (parts[0][:12], parts[1].lstrip("/") if len(parts) > 1 else "", label)
            containers[parts[0]] = current
        elif current and line.strip().isdigit():
            owner[int(line.strip())] = current
    gone: set[int] = set()
    for line in cgroups_text.splitlines():
        pid_text, _, cgroup = line.strip().partition(" ")
        if not pid_text.isdigit():
            continue
        if cgroup.strip() == "gone":
            gone.add(int(pid_text))
        elif int(pid_text) not in owner:
            placed = next((c for full, c in containers.items() if len(full) >= 12 and full in cgroup), None)
            if placed:
                owner[int(pid_text)] = placed
    found = []
    for line in ps_text.splitlines():
        match = re.match(r"^\s*(\d+)\s+(.*\S)", line)
        if not match or not is_ray_process(match.group(2)) or int(match.group(1)) in gone:
            continue
        pid = int(match.group(1))
        container = owner.get(pid, ("", "", ""))
        found.append(RayProcess(pid, match.group(2)[:120], *container))
    return found
