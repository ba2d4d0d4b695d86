"""The local lab: N "machines" on this one, each a container with its own IP, hostname, /etc/hosts,
sshd and Docker engine (Docker-in-Docker), on a private Docker network that the lab creates.

`lab_up` also loads the node image into every lab host and writes an inventory for them, so that
`doctor`, `up`, `bench` and `down` run against them exactly as against real machines (over SSH).
"""

from __future__ import annotations

import io
import ipaddress
import os
import socket
import subprocess
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .errors import OperationError, UsageError
from .progress import Progress, quiet
from .state import state_root

LAB_LABEL = "io.raycluster.lab"
# Several labs can live side by side on one machine (for example one per test session): each has its
# own name (container-name prefix, network name and label value), subnet and node image.
LAB_NAME = os.environ.get("RAYCLUSTER_LAB_NAME", "raycluster-lab")
NETWORK = LAB_NAME
DEFAULT_SUBNET = os.environ.get("RAYCLUSTER_LAB_SUBNET", "10.77.0.0/24")
LAB_IMAGE = os.environ.get("RAYCLUSTER_LAB_IMAGE", "raycluster/labhost:0.1.0")
NODE_IMAGE = os.environ.get("RAYCLUSTER_NODE_IMAGE", "raycluster/node:0.1.0")
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


def default_lab_dir() -> Path:
    return Path(os.environ.get("RAYCLUSTER_LAB_DIR") or state_root() / "lab")


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

    def to_dict(self) -> dict[str, Any]:
        return {
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


def docker_cli() -> str:
    """The engine's own client: /usr/bin/docker when installed from Debian, else the one on PATH."""
    return "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else "docker"


def lab_hosts(count: int, subnet: str = DEFAULT_SUBNET) -> list[LabHost]:
    net = ipaddress.ip_network(subnet)
    if count < 1 or count > 50:
        raise UsageError(f"--hosts {count} is out of range", "use 1 to 50 lab hosts")
    return [LabHost(f"{LAB_NAME}-h{i}", f"lab-h{i}", str(net.network_address + 10 + i)) for i in range(1, count + 1)]


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


def lab_up(
    count: int = 3,
    *,
    lab_dir: Path | None = None,
    node_image: str = NODE_IMAGE,
    lab_image: str = LAB_IMAGE,
    subnet: str = DEFAULT_SUBNET,
    host_options: dict[str, list[str]] | None = None,
    progress: Progress = quiet,
) -> LabInfo:
    """Start (or reuse) `count` lab hosts and write an inventory for them.

    `host_options` maps a lab hostname to extra `docker.run_options` for its Ray container in the
    written inventory (for example CPU quotas).
    """
    client = docker_client()
    lab_dir = lab_dir or default_lab_dir()
    lab_dir.mkdir(parents=True, exist_ok=True)
    for image in (lab_image, node_image):
        try:
            client.images.get(image)
        except Exception:
            raise OperationError(f"image {image} is not on this machine", "build it: make images") from None
    key_path = _ensure_key(lab_dir)
    public_key = (lab_dir / "id_ed25519.pub").read_text()
    _ensure_network(client, subnet)
    hosts = lab_hosts(count, subnet)
    running = set()
    for stale in client.containers.list(all=True, filters={"label": f"{LAB_LABEL}={LAB_NAME}"}):
        if stale.name not in {h.name for h in hosts}:
            progress(f"removing lab host {stale.name} (not part of a {count}-host lab)")
            stale.remove(force=True)
        elif stale.status == "running":
            running.add(stale.name)
    starting = sum(h.name not in running for h in hosts)
    warnings = judge_resources(starting, count, psutil.virtual_memory().available, psutil.cpu_count() or 1)
    for warning in warnings:
        progress(f"warning: {warning}")
    with ThreadPoolExecutor(max_workers=min(8, count)) as pool:
        list(pool.map(lambda h: _start_host(client, h, lab_image, public_key, progress), hosts))
        known = list(pool.map(lambda h: _wait_ready(client, h, progress), hosts))
        (lab_dir / "known_hosts").write_text("".join(known))
        list(pool.map(lambda h: load_image(h.name, node_image, progress), hosts))
    inventory_path = lab_dir / "inventory.yaml"
    inventory_path.write_text(
        render_inventory(hosts, key_path, lab_dir / "known_hosts", node_image, host_options or {})
    )
    progress(f"lab of {count} hosts ready; inventory: {inventory_path}")
    return LabInfo(lab_dir, inventory_path, hosts, warnings)


def lab_down(*, lab_dir: Path | None = None, keep_volumes: bool = False, progress: Progress = quiet) -> list[str]:
    """Remove every container, network and (unless kept) volume that the lab created."""
    client = docker_client()
    removed: list[str] = []
    for container in client.containers.list(all=True, filters={"label": f"{LAB_LABEL}={LAB_NAME}"}):
        progress(f"removing {container.name}")
        container.remove(force=True)
        removed.append(container.name)
    for network in client.networks.list(names=[NETWORK]):
        network.remove()
        removed.append(f"network {NETWORK}")
    if not keep_volumes:
        for volume in client.volumes.list(filters={"label": f"{LAB_LABEL}={LAB_NAME}"}):
            volume.remove(force=True)
            removed.append(f"volume {volume.name}")
    lab_dir = lab_dir or default_lab_dir()
    for name in ("inventory.yaml", "known_hosts"):
        (lab_dir / name).unlink(missing_ok=True)
    return removed


def render_inventory(
    hosts: list[LabHost],
    key_path: Path,
    known_hosts: Path,
    node_image: str,
    host_options: dict[str, list[str]],
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
        "docker": {"shm_size": "1g"},
        "hosts": [],
    }
    for index, host in enumerate(hosts):
        entry: dict[str, Any] = {"address": host.address, "role": "head" if index == 0 else "worker"}
        if host_options.get(host.hostname):
            entry["docker"] = {"run_options": host_options[host.hostname]}
        doc["hosts"].append(entry)
    header = "# Written by `raycluster lab up`: an inventory for the local lab hosts.\n"
    return header + yaml.safe_dump(doc, sort_keys=False)


def load_image(container: str, image: str, progress: Progress = quiet) -> bool:
    """Stream `image` into a lab host's engine unless it already has the same image ID."""
    docker = docker_cli()
    local_id = _run([docker, "image", "inspect", "--format", "{{.Id}}", image]).strip()
    remote = subprocess.run(
        [docker, "exec", container, "docker", "image", "inspect", "--format", "{{.Id}}", image],
        capture_output=True,
        text=True,
    )
    if remote.returncode == 0 and remote.stdout.strip() == local_id:
        return False
    progress(f"{container}: loading {image}")
    save = subprocess.Popen([docker, "save", image], stdout=subprocess.PIPE)
    load = subprocess.run(
        [docker, "exec", "-i", container, "docker", "load", "-q"], stdin=save.stdout, capture_output=True
    )
    assert save.stdout is not None
    save.stdout.close()
    save.wait()
    if save.returncode or load.returncode:
        raise OperationError(
            f"{container}: loading {image} failed: {load.stderr.decode(errors='replace').strip()[:200]}",
            "check free disk space (df -h /var/lib/docker) and retry `raycluster lab up`",
        )
    return True


def start_engine(container: str, timeout_s: float = 60.0) -> None:
    """(Re)start a lab host's own dockerd and wait until it answers."""
    docker = docker_cli()
    subprocess.run([docker, "exec", container, "/usr/local/sbin/labhost-start-dockerd"], check=True)
    deadline = time.monotonic() + timeout_s
    while subprocess.run([docker, "exec", container, "docker", "info"], capture_output=True).returncode != 0:
        if time.monotonic() > deadline:
            raise OperationError(
                f"{container}: dockerd did not start", f"see `docker exec {container} cat /var/log/dockerd.log`"
            )
        time.sleep(0.5)


def _run(argv: list[str]) -> str:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode:
        raise OperationError(f"{' '.join(argv[:3])} failed: {result.stderr.strip()[:200]}", "see the message")
    return result.stdout


def _ensure_key(lab_dir: Path) -> Path:
    key_path = lab_dir / "id_ed25519"
    if not key_path.exists():
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


def _ensure_network(client: Any, subnet: str) -> None:
    import docker

    if client.networks.list(names=[NETWORK]):
        return
    ipam = docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet=subnet)])
    try:
        client.networks.create(NETWORK, driver="bridge", ipam=ipam, labels={LAB_LABEL: LAB_NAME})
    except docker.errors.APIError as exc:
        raise OperationError(
            f"cannot create the lab network {subnet}: {exc.explanation}",
            "pick another subnet with --subnet, or remove the network that overlaps it",
        ) from None


def _start_host(client: Any, host: LabHost, image: str, public_key: str, progress: Progress) -> None:
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
        volume = f"{host.name}-docker"
        client.volumes.create(volume, labels={LAB_LABEL: LAB_NAME})
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
                volume: {"bind": "/var/lib/docker"},
            },
            environment={"LAB_CGROUP_PARENT": host.name},
            labels={LAB_LABEL: LAB_NAME},
            network=NETWORK,
        )
        client.api.disconnect_container_from_network(container.id, NETWORK)
        client.api.connect_container_to_network(container.id, NETWORK, ipv4_address=host.address)
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


def _wait_ready(client: Any, host: LabHost, progress: Progress, timeout_s: float = 120.0) -> str:
    """Poll until sshd accepts connections and the inner dockerd answers; return known_hosts lines."""
    container = client.containers.get(host.name)
    deadline = time.monotonic() + timeout_s
    while True:
        keys = container.exec_run(["sh", "-c", "cat /etc/ssh/ssh_host_*_key.pub"])
        docker_ok = container.exec_run(["docker", "info", "--format", "{{.ServerVersion}}"]).exit_code == 0
        if keys.exit_code == 0 and docker_ok and _port_open(host.address, 22):
            break
        if time.monotonic() > deadline:
            logs = container.logs(tail=5).decode(errors="replace").strip().replace("\n", " | ")
            raise OperationError(
                f"lab host {host.hostname} did not become ready in {timeout_s:.0f}s ({logs})",
                f"see `docker exec {host.name} cat /var/log/dockerd.log`",
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
