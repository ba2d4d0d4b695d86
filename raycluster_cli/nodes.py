"""One Ray node container on one host: its environment, what `up` must do with it, and doing it."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

from .checks.parsers import parse_ip_addr
from .containers import (
    ENV_IN_CONTAINER,
    LABEL_CLUSTER,
    LABEL_CONFIG,
    LABEL_ROLE,
    TOKEN_IN_CONTAINER,
    Container,
    config_hash,
    container_name,
    docker_run_command,
    env_file_content,
    env_path_on_host,
    inspect_name_command,
    parse_ps,
    run_argv,
)
from .engine import image_id
from .errors import OperationError
from .inventory import HostConfig, Inventory
from .transport import Transport, quote

DERIVED_ENV = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def node_env(inventory: Inventory, host: HostConfig, ip_addr_output: str) -> dict[str, str]:
    """The inventory's env for `host`, plus NCCL/GLOO_SOCKET_IFNAME = the NIC holding the node IP (pure).

    Collective libraries otherwise pick an interface by themselves, often docker0 or a management NIC.
    """
    env = inventory.env_for(host)
    ip = inventory.node_ip(host)
    nic = next((i.name for i in parse_ip_addr(ip_addr_output) if i.address == ip), None)
    for name in DERIVED_ENV:
        if nic and name not in env:
            env[name] = nic
    return env


def prepare(transport: Transport, inventory: Inventory, host: HostConfig) -> bytes:
    """Write the host's env file (0600, in the host state folder, see hoststate.py); return its content."""
    nics = transport.run("ip -o -4 addr show", timeout=30)
    content = env_file_content(node_env(inventory, host, nics.stdout if nics.ok else ""))
    transport.put(content, env_path_on_host(inventory, host))
    return content


@dataclass(frozen=True)
class Plan:
    action: str  # "keep" / "start" / "replace"
    reason: str = ""


def files_digest(env: bytes, token: bytes | None) -> str:
    """Digest of the files a container reads at start (env file, token file): the same digest is computed
    inside a running container, so a changed env or token is seen without either crossing the wire."""
    return hashlib.sha256(env + (token or b"")).hexdigest()


def plan_node(transport: Transport, inventory: Inventory, host: HostConfig, digest: str, force: str = "") -> Plan:
    """What `up` must do on `host`; refuse a container named like ours that this cluster did not start."""
    name = container_name(inventory, host)
    found = parse_ps(transport.run(inspect_name_command(name)).stdout)
    if not found:
        return Plan("start")
    existing = found[0]
    if existing.labels.get(LABEL_CLUSTER) != inventory.cluster or existing.labels.get(LABEL_ROLE) != host.role:
        raise OperationError(
            f"{host.address}: a container named {name} exists that this cluster did not start",
            f"remove or rename it on {host.address} (docker rm -f {name}) if it is not needed",
        )
    image_ids, seen = _container_view(transport, existing, inventory.image)
    return Plan(*decide(existing, inventory, host, force, image_ids, seen, digest))


def decide(
    existing: Container,
    inventory: Inventory,
    host: HostConfig,
    force: str,
    image_ids: tuple[str, str],
    files_seen: str | None,
    files_wanted: str | None = None,
) -> tuple[str, str]:
    """(action, reason) for one of our own containers (pure). Our containers are replaced when what the
    inventory asks for changed; the reason says what changed."""
    if not existing.running:
        return "replace", f"container {existing.state}"
    if force:
        return "replace", force
    if existing.labels.get(LABEL_CONFIG) != config_hash(run_argv(inventory, host)):
        return "replace", "configuration changed (docker options, resources or Ray settings)"
    if image_ids[0] != image_ids[1]:
        return "replace", f"image changed ({image_ids[0][7:19]} → {image_ids[1][7:19]})"
    if files_wanted is not None and files_seen != files_wanted:
        return "replace", "env or auth token changed"
    return "keep", ""


def _container_view(transport: Transport, existing: Container, image: str) -> tuple[tuple[str, str], str | None]:
    """The container's image ID, the image name's ID now, and the digest of the files the container started
    with (bind mounts keep the file a container started with, even after `up` rewrote the host's copy)."""
    sep = "--raycluster--"
    files = f"cat {ENV_IN_CONTAINER} {TOKEN_IN_CONTAINER} 2>/dev/null | sha256sum"
    out = transport.run(
        f"docker inspect --format '{{{{.Image}}}}' {quote(existing.id)}; echo {sep}; "
        f"docker image inspect --format '{{{{.Id}}}}' {quote(image)}; echo {sep}; "
        f"docker exec {quote(existing.id)} sh -c {quote(files)}"
    ).stdout
    parts = out.split(sep)
    ids = (image_id(parts[0]), image_id(parts[1]) or "?") if len(parts) > 1 else ("", "?")
    digest = parts[2].split()[0] if len(parts) > 2 and parts[2].split() else None
    return ids, digest


def apply(transport: Transport, inventory: Inventory, host: HostConfig, plan: Plan) -> str:
    """Carry out a plan; return the action taken (running / started / restarted)."""
    if plan.action == "keep":
        return "running"
    if plan.action == "replace":
        transport.run("docker rm -f " + quote(container_name(inventory, host)))
    result = transport.run(docker_run_command(inventory, host), timeout=120)
    if not result.ok:
        raise OperationError(
            f"{host.address}: docker run failed: {result.first_line()}",
            "check the image and docker.run_options in the inventory",
        )
    return "started" if plan.action == "start" else "restarted"


def wait_head(transport: Transport, inventory: Inventory, timeout_s: float) -> None:
    name = container_name(inventory, inventory.head_host)
    address = f"{inventory.head_address}:{inventory.ray.port}"
    deadline = time.monotonic() + timeout_s
    while True:
        state = parse_ps(transport.run(inspect_name_command(name)).stdout)
        if not state or not state[0].running:
            raise OperationError(
                f"{inventory.head_host.address}: the head container exited: {tail(transport, name)}",
                f"see `docker logs {name}` on {inventory.head_host.address}",
            )
        check = transport.run(f"docker exec {quote(name)} ray health-check --address {quote(address)}", timeout=60)
        if check.ok:
            return
        if time.monotonic() > deadline:
            raise OperationError(
                f"{inventory.head_host.address}: the head's GCS did not answer within {timeout_s:.0f}s: "
                f"{tail(transport, name)}",
                f"see `docker logs {name}` on {inventory.head_host.address}",
            )
        time.sleep(1.0)


def probe(
    transport: Transport, inventory: Inventory, expect: list[str], timeout_s: float, stale: list[str] | None = None
) -> list[dict[str, Any]]:
    """The cluster's nodes, after waiting (up to `timeout_s`) for `expect` to be live and `stale` dead."""
    name = container_name(inventory, inventory.head_host)
    gcs = f"{inventory.head_address}:{inventory.ray.port}"
    command = (
        f"docker exec {quote(name)} python -m raycluster_cli.probe --address {quote(gcs)} "
        f"--expect {quote(','.join(expect))} --stale-ids {quote(','.join(stale or []))}"
    )
    result = transport.run(f"{command} --timeout {timeout_s:.0f}", timeout=timeout_s + 60)
    try:
        document = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise OperationError(
            f"{inventory.head_host.address}: cannot read the cluster's nodes: {result.first_line()}",
            f"see `docker logs {name}`",
        ) from None
    if "nodes" not in document:
        raise OperationError(f"{inventory.head_host.address}: {document.get('error')}", f"see `docker logs {name}`")
    nodes: list[dict[str, Any]] = document["nodes"]
    return nodes


def tail(transport: Transport, name: str, lines: int = 3) -> str:
    out = transport.run(f"docker logs --tail {lines} {quote(name)} 2>&1")
    return " | ".join(line.strip() for line in out.stdout.splitlines() if line.strip())[-300:] or "(no log)"
