"""Ray node containers on a host: the `docker run` line, ownership labels, listing and removal.

Everything here is a command string built from the inventory plus a parser of Docker's output, so it is
unit-tested without Docker; `cluster.py` runs these commands through a transport.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from .errors import OperationError
from .inventory import HostConfig, Inventory
from .transport import Transport, quote

LABEL_CLUSTER = "io.raycluster.cluster"
LABEL_ROLE = "io.raycluster.role"
LABEL_MANAGED = "io.raycluster.managed-by"
TOKEN_IN_CONTAINER = "/run/raycluster/auth-token"


def container_name(inventory: Inventory, host: HostConfig) -> str:
    return f"raycluster-{inventory.cluster}-{host.role}"


def token_path_on_host(inventory: Inventory) -> str:
    return f"/etc/raycluster/{inventory.cluster}/auth-token"


def ray_start_args(inventory: Inventory, host: HostConfig) -> list[str]:
    ray = inventory.ray
    node_ip = inventory.node_ip(host)
    if host.role == "head":
        args = [
            "ray", "start", "--head", f"--port={ray.port}", f"--node-ip-address={node_ip}",
            f"--dashboard-host={node_ip}", f"--dashboard-port={ray.dashboard_port}",
            f"--ray-client-server-port={ray.client_port}",
        ]  # fmt: skip
    else:
        args = [
            "ray",
            "start",
            f"--address={inventory.head_address}:{ray.port}",
            f"--node-ip-address={node_ip}",
        ]
    if host.num_cpus is not None:
        args.append(f"--num-cpus={host.num_cpus:g}")
    if host.num_gpus is not None:
        args.append(f"--num-gpus={host.num_gpus}")
    if ray.object_store_memory:
        args.append(f"--object-store-memory={ray.object_store_memory}")
    args += [f"--min-worker-port={ray.min_worker_port}", f"--max-worker-port={ray.max_worker_port}"]
    args.append("--block")
    return args


def docker_run_command(inventory: Inventory, host: HostConfig) -> str:
    """The `docker run` that starts the Ray node on `host` (host network, node IP pinned, labelled)."""
    docker = inventory.docker_for(host)
    argv = [
        "docker", "run", "--detach", "--init", f"--name={container_name(inventory, host)}", "--network=host",
        f"--label={LABEL_CLUSTER}={inventory.cluster}", f"--label={LABEL_ROLE}={host.role}",
        f"--label={LABEL_MANAGED}=raycluster",
    ]  # fmt: skip
    if docker.shm_size:
        argv.append(f"--shm-size={docker.shm_size}")
    if host.hostname:
        argv.append(f"--hostname={host.hostname}")
    if inventory.ray.auth == "token":
        argv += [
            "--env=RAY_AUTH_MODE=token",
            f"--env=RAY_AUTH_TOKEN_PATH={TOKEN_IN_CONTAINER}",
            f"--volume={token_path_on_host(inventory)}:{TOKEN_IN_CONTAINER}:ro",
        ]
    for option in docker.run_options:
        argv += shlex.split(option)
    argv.append(inventory.image)
    argv += ray_start_args(inventory, host)
    return quote(*argv)


@dataclass(frozen=True)
class Container:
    id: str
    name: str
    state: str  # running, exited, created, ...
    image: str
    labels: dict[str, str]

    @property
    def running(self) -> bool:
        return self.state == "running"


def list_command(inventory: Inventory) -> str:
    return (
        "docker ps --all --no-trunc --filter "
        + quote(f"label={LABEL_CLUSTER}={inventory.cluster}")
        + (" --format '{{json .}}'")
    )


def inspect_name_command(name: str) -> str:
    return "docker ps --all --no-trunc --filter " + quote(f"name=^{name}$") + " --format '{{json .}}'"


def parse_ps(text: str) -> list[Container]:
    """Parse `docker ps --format '{{json .}}'` (one JSON object per line)."""
    found = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        row = json.loads(line)
        labels = dict(
            item.split("=", 1) if "=" in item else (item, "") for item in row.get("Labels", "").split(",") if item
        )
        found.append(Container(row["ID"], row["Names"], row.get("State", ""), row.get("Image", ""), labels))
    return found


def list_cluster_containers(transport: Transport, inventory: Inventory) -> list[Container]:
    result = transport.run(list_command(inventory))
    if not result.ok:
        raise OperationError(f"{transport.host}: docker ps failed: {result.first_line()}", "check Docker on the host")
    return [c for c in parse_ps(result.stdout) if c.labels.get(LABEL_CLUSTER) == inventory.cluster]
