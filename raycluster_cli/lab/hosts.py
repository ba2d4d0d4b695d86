"""The local lab: N "machines" on this one, each a container with its own IP, hostname, /etc/hosts,
sshd and Docker engine (Docker-in-Docker), on a private Docker network that the lab creates.

`lab_up` also loads the node image into every lab host (unless told not to: a fleet lab of dozens of
hosts for doctor/status/down and image distribution needs no Ray) and writes an inventory for them, so
that `doctor`, `up`, `bench` and `down` run against them exactly as against real machines (over SSH).
This machine's Docker engine is reached through one client, the docker SDK.
"""

from __future__ import annotations

import io
import ipaddress
import math
import os
import socket
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raycluster_cli.config.defaults import DEFAULT_SUBNET, LAB_NAME, MAX_HOSTS, NODE_IMAGE
from raycluster_cli.config.state import state_root
from raycluster_cli.errors import OperationError, UsageError
from raycluster_cli.lab.engines import DOCKER, ENGINES, LabEngine, load_image
from raycluster_cli.progress import Progress, quiet

LAB_LABEL = "io.raycluster.lab"
# What one lab host costs this machine: sshd + dockerd idle (30 hosts measured ~3 GB), and a Ray node with
# a small object store that `up` will start in it; past HOSTS_PER_CORE hosts a core, Ray nodes crawl.
LAB_HOST_MEMORY = 128 * 2**20
RAY_NODE_MEMORY = 3 * 2**29
HOSTS_PER_CORE = 4
# Every capability Docker 20.10 knows but CAP_SYS_RESOURCE, which this kind of sandbox withholds
# (so --privileged fails there).
_CAPS = [
    "AUDIT_CONTROL",
    "AUDIT_READ",
    "AUDIT_WRITE",
    "BLOCK_SUSPEND",
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "IPC_LOCK",
    "IPC_OWNER",
    "KILL",
    "LEASE",
    "LINUX_IMMUTABLE",
    "MAC_ADMIN",
    "MAC_OVERRIDE",
    "MKNOD",
    "NET_ADMIN",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_RAW",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_CHROOT",
    "SYS_MODULE",
    "SYS_NICE",
    "SYS_PACCT",
    "SYS_PTRACE",
    "SYS_RAWIO",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "SYSLOG",
    "WAKE_ALARM",
]


def default_lab_dir(name: str = LAB_NAME) -> Path:
    """Where a lab keeps its key, known_hosts and inventory: one folder per lab name."""
    if os.environ.get("RAYCLUSTER_LAB_DIR"):
        return Path(os.environ["RAYCLUSTER_LAB_DIR"])
    return state_root() / ("lab" if name == "raycluster-lab" else f"lab-{name}")


@dataclass(frozen=True)
class LabHost:
    name: str  # the container's name on this machine
    hostname: str
    address: str


@dataclass
class LabInfo:
    lab_dir: Path
    inventory_path: Path
    hosts: list[LabHost] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    name: str = LAB_NAME
    network: str = LAB_NAME

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "network": self.network,
            "lab_dir": str(self.lab_dir),
            "inventory": str(self.inventory_path),
            "hosts": [{"name": h.name, "hostname": h.hostname, "address": h.address} for h in self.hosts],
            "warnings": self.warnings,
        }


def docker_client() -> Any:
    import docker

    try:
        client = docker.from_env(version="auto", timeout=120)
        client.ping()
    except Exception as exc:
        raise OperationError(
            f"no Docker engine answers on this machine ({type(exc).__name__})",
            "start one with scripts/ensure-docker.sh (or `make docker`)",
        ) from None
    return client


def lab_hosts(count: int, subnet: str = DEFAULT_SUBNET, name: str = LAB_NAME) -> list[LabHost]:
    """The hosts of a `count`-host lab: addresses from the subnet's 11th on, hostnames lab-h1…"""
    net = ipaddress.ip_network(subnet)
    room = net.num_addresses - 12  # network, gateway and the first ten addresses stay free, and broadcast
    if count < 1 or count > min(MAX_HOSTS, room):
        raise UsageError(
            f"--hosts {count} is out of range for subnet {subnet}",
            f"use 1 to {min(MAX_HOSTS, max(room, 0))} lab hosts, or a larger --subnet",
        )
    return [LabHost(f"{name}-h{i}", f"lab-h{i}", str(net.network_address + 10 + i)) for i in range(1, count + 1)]


def judge_resources(starting: int, total: int, available: int, cores: int) -> list[str]:
    """Warnings about this machine's memory and cores for a lab of ``total`` hosts, ``starting`` of them new;
    raises when even the new hosts' sshd and dockerd would not fit in the available memory."""
    gib = 2**30
    if starting and available < starting * LAB_HOST_MEMORY:
        raise OperationError(
            f"starting {starting} lab host(s) needs about {starting * LAB_HOST_MEMORY / gib:.1f} GiB of memory;"
            f" this machine has {available / gib:.1f} GiB available",
            "use fewer --hosts, or free memory (raycluster lab down removes an old lab)",
        )
    warnings = []
    if starting and available < total * RAY_NODE_MEMORY:
        warnings.append(
            f"{available / gib:.1f} GiB of memory available: enough for {total} lab hosts, not for a Ray node on each"
            f" (about {total * RAY_NODE_MEMORY / gib:.1f} GiB); `up` may fail or swap"
        )
    if starting and total > HOSTS_PER_CORE * cores:
        warnings.append(f"{total} lab hosts share {cores} core(s): Ray nodes on all of them will be slow to start")
    return warnings


CFS_PERIOD_US = 5_000  # the lab's CFS period for a host's CPU quota (Docker's --cpus means 100 ms)
MIN_CFS_QUOTA_US = 1_000  # the kernel refuses a smaller quota


def cpu_options(value: str, option: str = "--cpu-quotas") -> list[str]:
    """``docker run`` options that make a Ray container ``value`` CPUs fast, evenly over time.

    The lab stands in for slower machines with a CFS quota. With Docker's ``--cpus`` (a 100 ms period) a
    0.25-CPU container that waited for work runs its next 25 ms at full core speed and then stops for 75 ms:
    a real machine a quarter as fast is a quarter as fast all the time. A 5 ms period (longer only where the
    quota would fall under the kernel's 1 ms) spreads the same share over each call, as Kubernetes' shorter
    ``cpu-cfs-quota-period`` does for latency.
    """
    try:
        cpus = float(value)
    except ValueError:
        cpus = -1.0
    if not 0 < cpus <= 1024:
        raise UsageError(f"{option}: {value!r} is not a number of CPUs", "e.g. --cpu-quotas 1.0,0.5,0.25")
    period = max(CFS_PERIOD_US, math.ceil(MIN_CFS_QUOTA_US / cpus))
    return [f"--cpu-period={period}", f"--cpu-quota={round(cpus * period)}"]


def quota_options(spec: str, count: int) -> dict[str, list[str]]:
    """``"1.0,0.5,0.25"``: the Ray container on lab-h1 gets 1 CPU, lab-h2 0.5, lab-h3 0.25 (`cpu_options`).

    Unequal hosts on one machine, for `bench` to balance (``make demo`` uses them).
    """
    values = [v.strip() for v in spec.split(",") if v.strip()]
    if len(values) > count:
        raise UsageError(f"--cpu-quotas has {len(values)} values for {count} host(s)", "give one per host at most")
    return {f"lab-h{index}": cpu_options(value) for index, value in enumerate(values, start=1)}


def _keep_running(client: Any, name: str, hosts: list[LabHost], progress: Progress) -> set[str]:
    """Remove the lab's containers that are not among `hosts`; the names of those still running."""
    running = set()
    for stale in client.containers.list(all=True, filters={"label": f"{LAB_LABEL}={name}"}):
        if stale.name not in {h.name for h in hosts}:
            progress(f"removing lab host {stale.name} (not part of a {len(hosts)}-host lab)")
            stale.remove(force=True)
        elif stale.status == "running":
            running.add(stale.name)
    return running


def lab_up(
    count: int = 3,
    *,
    lab_dir: Path | None = None,
    node_image: str = NODE_IMAGE,
    subnet: str = DEFAULT_SUBNET,
    name: str = LAB_NAME,
    load_node_image: bool = True,
    host_options: dict[str, list[str]] | None = None,
    engine: str = "docker",
    lab_image: str | None = None,
    progress: Progress = quiet,
) -> LabInfo:
    """Start (or reuse) `count` lab hosts of the lab called `name` and write an inventory for them.

    Several labs live side by side: each `name` has its own containers, network, volumes and folder.
    `load_node_image=False` leaves the node image off the hosts (a fleet lab for doctor/status/down and
    for image distribution, which needs hosts without it); the inventory still names it.
    `host_options` maps a lab hostname to extra `docker.run_options` for its Ray container in the
    written inventory (for example CPU quotas). `engine` is the container engine inside the hosts, docker or
    podman (`lab_image` defaults to that engine's lab host image); the inventory names it as docker.engine.
    """
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine!r} is not a lab engine", "use docker or podman")
    kind = ENGINES[engine]
    lab_image = lab_image or kind.image
    client = docker_client()
    lab_dir = lab_dir or default_lab_dir(name)
    lab_dir.mkdir(parents=True, exist_ok=True)
    for image in (lab_image, node_image) if load_node_image else (lab_image,):
        try:
            client.images.get(image)
        except Exception:
            raise OperationError(f"image {image} is not on this machine", "build it: make images") from None
    hosts = lab_hosts(count, subnet, name)
    key_path = _ensure_key(lab_dir)
    public_key = (lab_dir / "id_ed25519.pub").read_text()
    _ensure_network(client, name, subnet)
    running = _keep_running(client, name, hosts, progress)
    starting = sum(h.name not in running for h in hosts)
    import psutil  # here, not at the top: `raycluster doctor` imports this module for the lab verbs' defaults

    warnings = judge_resources(starting, count, psutil.virtual_memory().available, psutil.cpu_count() or 1)
    for warning in warnings:
        progress(f"warning: {warning}")
    with ThreadPoolExecutor(max_workers=min(16, count)) as pool:
        list(pool.map(lambda h: _start_host(client, h, lab_image, name, public_key, progress, kind), hosts))
        known = list(pool.map(lambda h: _wait_ready(client, h, progress, kind), hosts))
        (lab_dir / "known_hosts").write_text("".join(known))
    if load_node_image:
        load_image(client, [h.name for h in hosts], node_image, progress, kind)
    inventory_path = lab_dir / "inventory.yaml"
    inventory_path.write_text(
        render_inventory(hosts, key_path, lab_dir / "known_hosts", node_image, host_options or {}, engine)
    )
    progress(f"lab {name} of {count} hosts ready; inventory: {inventory_path}")
    return LabInfo(lab_dir, inventory_path, hosts, warnings, name, name)


def lab_down(
    *, lab_dir: Path | None = None, keep_volumes: bool = False, name: str = LAB_NAME, progress: Progress = quiet
) -> list[str]:
    """Remove every container, network and (unless kept) volume that the lab called `name` created."""
    client = docker_client()
    removed: list[str] = []
    containers = client.containers.list(all=True, filters={"label": f"{LAB_LABEL}={name}"})
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(containers)))) as pool:
        list(pool.map(lambda c: c.remove(force=True), containers))
    for container in containers:
        progress(f"removed {container.name}")
        removed.append(container.name)
    for network in client.networks.list(names=[name]):
        if network.name == name:
            _remove_network(network)
            removed.append(f"network {name}")
    if not keep_volumes:
        for volume in client.volumes.list(filters={"label": f"{LAB_LABEL}={name}"}):
            volume.remove(force=True)
            removed.append(f"volume {volume.name}")
    lab_dir = lab_dir or default_lab_dir(name)
    for file in ("inventory.yaml", "known_hosts"):
        (lab_dir / file).unlink(missing_ok=True)
    return removed


def _remove_network(network: Any, timeout_s: float = 60.0) -> None:
    """Remove a network; the engine may still hold endpoints of containers just removed: retry a while."""
    import docker

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            network.remove()
            return
        except docker.errors.APIError as exc:
            if "active endpoints" not in str(exc) or time.monotonic() > deadline:
                raise OperationError(
                    f"cannot remove the lab network {network.name}: {exc.explanation}",
                    f"see `docker network inspect {network.name}`, then retry `raycluster lab down`",
                ) from None
            time.sleep(1)


def render_inventory(
    hosts: list[LabHost],
    key_path: Path,
    known_hosts: Path,
    node_image: str,
    host_options: dict[str, list[str]],
    engine: str = "docker",
) -> str:
    doc: dict[str, Any] = {
        "cluster": "lab",
        "image": node_image,
        "ssh": {
            "user": "root",
            "key": str(key_path),
            "port": 22,
            "known_hosts": "strict",
            "known_hosts_file": str(known_hosts),
        },
        "head": {"address": hosts[0].address},
        # Three Ray nodes share this machine's memory: keep each object store small.
        "ray": {"object_store_memory": 300_000_000},
        "docker": {"shm_size": "1g"} if engine == "docker" else {"shm_size": "1g", "engine": engine},
        "hosts": [],
    }
    for index, host in enumerate(hosts):
        entry: dict[str, Any] = {"address": host.address, "role": "head" if index == 0 else "worker"}
        if host_options.get(host.hostname):
            entry["docker"] = {"run_options": host_options[host.hostname]}
        doc["hosts"].append(entry)
    header = "# Written by `raycluster lab up`: an inventory for the local lab hosts.\n"
    return header + yaml.safe_dump(doc, sort_keys=False)


def _ensure_key(lab_dir: Path) -> Path:
    key_path = lab_dir / "id_ed25519"
    if not key_path.exists():
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        key = Ed25519PrivateKey.generate()
        private = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        )
        public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(private)
        (lab_dir / "id_ed25519.pub").write_bytes(public + b" raycluster-lab\n")
    return key_path


def _networks_over(networks: list[Any], subnet: str, name: str) -> list[tuple[str, str, str | None]]:
    """Of `networks` (the engine's, listed once), those other than `name` whose subnets overlap `subnet`:
    (network, its subnet, the lab it belongs to or None)."""
    wanted = ipaddress.ip_network(subnet)
    found = []
    for network in networks:
        attrs = network.attrs or {}
        if network.name == name:
            continue
        for pool in (attrs.get("IPAM") or {}).get("Config") or []:
            theirs = pool.get("Subnet")
            try:
                overlaps = bool(theirs) and ipaddress.ip_network(theirs).overlaps(wanted)
            except (TypeError, ValueError):  # an IPv6 pool against an IPv4 subnet, or a malformed one
                overlaps = False
            if overlaps:
                found.append((network.name, theirs, (attrs.get("Labels") or {}).get(LAB_LABEL)))
    return found


def free_subnet(preferred: str, name: str = LAB_NAME, client: Any = None) -> str:
    """`preferred` if no Docker network but the lab's own (`name`) overlaps it, else the first /24 of the same
    size in 10.64.0.0/10 that none overlaps: for the tests' second labs, which must not fail because a lab left
    by an interrupted run holds their default subnet."""
    networks = (client or docker_client()).networks.list()
    if not _networks_over(networks, preferred, name):
        return preferred
    size = ipaddress.ip_network(preferred).prefixlen
    for candidate in ipaddress.ip_network("10.64.0.0/10").subnets(new_prefix=max(size, 10)):
        if not _networks_over(networks, str(candidate), name):
            return str(candidate)
    raise OperationError(
        f"no free subnet for the lab {name}: every /{size} of 10.64.0.0/10 overlaps a Docker network",
        "remove the labs you no longer need with `raycluster lab down --name NAME`",
    )


def _ensure_network(client: Any, name: str, subnet: str) -> None:
    import docker

    if any(n.name == name for n in client.networks.list(names=[name])):
        return
    ipam = docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet=subnet)])
    try:
        client.networks.create(name, driver="bridge", ipam=ipam, labels={LAB_LABEL: name})
    except docker.errors.APIError as exc:
        others = _networks_over(client.networks.list(), subnet, name)
        labs = sorted({lab for _, _, lab in others if lab})
        if labs:
            fix = f"remove that lab with `raycluster lab down --name {labs[0]}`, or pick another subnet with --subnet"
        else:
            fix = "pick another subnet with --subnet, or remove the network that overlaps it"
        held = ", ".join(f"{net} ({theirs})" for net, theirs, _ in others) or "another network"
        raise OperationError(
            f"cannot create the lab network {subnet}: {exc.explanation}; held by {held}", fix
        ) from None


def _start_host(
    client: Any, host: LabHost, image: str, lab: str, public_key: str, progress: Progress, engine: LabEngine = DOCKER
) -> None:
    import docker

    try:
        container = client.containers.get(host.name)
        if container.image.id != client.images.get(image).id:
            progress(f"lab host {host.hostname} runs an older lab image: recreating it")
            container.remove(force=True)
            raise docker.errors.NotFound(host.name)
        if container.status != "running":
            container.start()
    except docker.errors.NotFound:
        progress(f"starting lab host {host.hostname} ({host.address})")
        volume = f"{host.name}-{engine.name}"  # the engine's images and containers, kept by `lab down --keep-volumes`
        client.volumes.create(volume, labels={LAB_LABEL: lab})
        container = client.containers.create(
            image,
            name=host.name,
            hostname=host.hostname,
            detach=True,
            init=True,
            cap_add=_CAPS,
            security_opt=["seccomp=unconfined", "apparmor=unconfined"],
            volumes={
                "/sys/fs/cgroup": {"bind": "/sys/fs/cgroup", "mode": "rw"},
                volume: {"bind": engine.storage},
            },
            environment={"LAB_CGROUP_PARENT": host.name},
            labels={LAB_LABEL: lab},
            network=lab,
        )
        client.api.disconnect_container_from_network(container.id, lab)
        client.api.connect_container_to_network(container.id, lab, ipv4_address=host.address)
        container.start()
    container.put_archive("/root/.ssh", _tar({"authorized_keys": public_key.encode()}, mode=0o600))


def _tar(files: dict[str, bytes], mode: int) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _wait_ready(
    client: Any, host: LabHost, progress: Progress, engine: LabEngine = DOCKER, timeout_s: float = 300.0
) -> str:
    """Poll until sshd accepts connections and the inner engine answers; return known_hosts lines."""
    container = client.containers.get(host.name)
    deadline = time.monotonic() + timeout_s
    while True:
        docker_ok = container.exec_run(["sh", "-c", engine.ready]).exit_code == 0
        # The host keys are read once sshd listens: ssh-keygen has then written them whole.
        if docker_ok and _port_open(host.address, 22):
            keys = container.exec_run(["sh", "-c", "cat /etc/ssh/ssh_host_*_key.pub"])
            if keys.exit_code == 0 and keys.output.count(b"\n") >= 2:
                break
        if time.monotonic() > deadline:
            logs = container.logs(tail=5).decode(errors="replace").strip().replace("\n", " | ")
            raise OperationError(
                f"lab host {host.hostname} did not become ready in {timeout_s:.0f}s ({logs})",
                f"see `docker exec {host.name} cat /var/log/dockerd.log`"
                if engine.name == "docker"
                else f"see `docker logs {host.name}`",
            )
        time.sleep(0.5)
    progress(f"lab host {host.hostname} ready")
    lines = []
    for line in keys.output.decode().splitlines():
        parts = line.split()
        if len(parts) >= 2:
            lines.append(f"{host.address} {parts[0]} {parts[1]}\n")
    return "".join(lines)


def _port_open(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1):
            return True
    except OSError:
        return False
