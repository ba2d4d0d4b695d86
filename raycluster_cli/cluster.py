"""Cluster lifecycle: up (head first, then workers in parallel, wait until all joined), down, bench.

Never prints: progress goes through the callback the caller gives.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checks import CheckResult, Status, run_checks
from .containers import (
    LABEL_CLUSTER,
    LABEL_ROLE,
    container_name,
    docker_run_command,
    inspect_name_command,
    list_cluster_containers,
    parse_ps,
    token_path_on_host,
)
from .errors import OperationError, RayclusterError
from .inventory import HostConfig, Inventory
from .transport import Transport, quote
from .transport.fanout import fanout
from .transport.ssh import SSHTransport

Progress = Callable[[str], None]
Connect = Callable[[HostConfig], Transport]


def _quiet(_: str) -> None:
    pass


class PreflightFailed(RayclusterError):
    def __init__(self, results: list[CheckResult]) -> None:
        failed = [r for r in results if r.status == Status.FAIL]
        first = failed[0]
        super().__init__(
            f"{len(failed)} preflight check(s) failed, first: {first.host} {first.id}: {first.message}",
            "run `raycluster doctor` for all of them, fix them, or pass --ignore ID",
        )
        self.results = results


class SSHPool:
    """One SSH connection per host, opened on first use, closed together."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        self._open: dict[str, Transport] = {}

    def __call__(self, host: HostConfig) -> Transport:
        key = str(host.address)
        if key not in self._open:
            ssh = self.inventory.ssh_for(host)
            transport = SSHTransport(
                key,
                user=ssh.user,
                port=ssh.port,
                key_file=ssh.key,
                known_hosts=ssh.known_hosts,
                known_hosts_file=ssh.known_hosts_file,
                connect_timeout=ssh.connect_timeout_s,
            )
            transport.connect()
            self._open[key] = transport
        return self._open[key]

    def close(self) -> None:
        for transport in self._open.values():
            transport.close()
        self._open.clear()


def state_dir(inventory: Inventory) -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(os.environ.get("RAYCLUSTER_STATE_DIR") or Path(base) / "raycluster") / inventory.cluster


def ensure_token(inventory: Inventory) -> bytes:
    """The cluster's Ray auth token, made once on the operator machine (mode 0600)."""
    path = state_dir(inventory) / "auth-token"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32))
    return path.read_bytes().strip()


@dataclass
class NodeState:
    host: str
    role: str
    node_ip: str
    alive: bool
    action: str = ""  # started / running / restarted
    resources: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "role": self.role,
            "node_ip": self.node_ip,
            "alive": self.alive,
            "action": self.action,
            "resources": self.resources,
        }


@dataclass
class UpResult:
    head: str
    dashboard_url: str
    nodes: list[NodeState]
    checks: list[CheckResult]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(n.alive for n in self.nodes)


def up(
    inventory: Inventory,
    connect: Connect,
    *,
    ignore: frozenset[str] = frozenset(),
    timeout_s: float = 180.0,
    progress: Progress = _quiet,
) -> UpResult:
    started = time.monotonic()
    progress("running preflight checks")
    checks = run_checks(inventory, connect, ignore=ignore)
    if any(r.status == Status.FAIL for r in checks):
        raise PreflightFailed(checks)
    if inventory.ray.auth == "token":
        token = ensure_token(inventory)
        _raise_first(fanout(inventory.hosts, lambda h: connect(h).put(token, token_path_on_host(inventory))))
    head = inventory.head_host
    head_transport = connect(head)
    progress(f"starting the head on {head.address}")
    head_action = _apply_node(head_transport, inventory, head, _plan_node(head_transport, inventory, head))
    _wait_head(head_transport, inventory, timeout_s)
    progress(f"head ready; starting {len(inventory.workers)} worker(s)")
    force = head_action != "running"  # a new head means every worker must join it again
    plans = fanout(inventory.workers, lambda h: _plan_node(connect(h), inventory, h, force=force))
    _raise_first(plans)
    plan_of = {str(h.address): o.value or "" for h, o in plans}
    replaced = {inventory.node_ip(h) for h in inventory.workers if plan_of[str(h.address)] != "running"}
    # With the head kept, nodes of workers about to be replaced may linger in its GCS: note their IDs.
    before = _probe(head_transport, inventory, [], 0) if replaced and not force else []
    stale = [n["node_id"] for n in before if n["alive"] and n["node_ip"] in replaced]
    actions = fanout(inventory.workers, lambda h: _apply_node(connect(h), inventory, h, plan_of[str(h.address)]))
    _raise_first(actions)
    progress("waiting for every node to join")
    expected = {inventory.node_ip(h): h for h in inventory.hosts}
    reported = _probe(head_transport, inventory, sorted(expected), timeout_s, stale)
    alive = {n["node_ip"]: n for n in reported if n["alive"] and n["node_id"] not in stale}
    action_of = {str(head.address): head_action} | {str(h.address): o.value or "" for h, o in actions}
    nodes = [
        NodeState(
            str(h.address),
            h.role,
            ip,
            ip in alive,
            action_of.get(str(h.address), ""),
            alive.get(ip, {}).get("resources", {}),
        )
        for ip, h in expected.items()
    ]
    missing = [n for n in nodes if not n.alive]
    if missing:
        names = ", ".join(n.host for n in missing)
        first = next(h for h in inventory.hosts if str(h.address) == missing[0].host)
        tail = _log_tail(connect, inventory, first)
        raise OperationError(
            f"{len(missing)} node(s) did not join within {timeout_s:.0f}s: {names} (last log on {first.address}: {tail})",
            f"see `docker logs {container_name(inventory, first)}` on {first.address} and run `raycluster doctor`",
        )
    return UpResult(
        inventory.head_address,
        f"http://{inventory.head_address}:{inventory.ray.dashboard_port}",
        nodes,
        checks,
        time.monotonic() - started,
    )


def _raise_first(outcomes: list[Any]) -> None:
    for _, outcome in outcomes:
        if outcome.error is not None:
            raise outcome.error


def _plan_node(transport: Transport, inventory: Inventory, host: HostConfig, force: bool = False) -> str:
    """What `up` must do on `host`: "running" (keep), "start" or "restart"; refuse a foreign container."""
    name = container_name(inventory, host)
    found = parse_ps(transport.run(inspect_name_command(name)).stdout)
    if not found:
        return "start"
    existing = found[0]
    if existing.labels.get(LABEL_CLUSTER) != inventory.cluster or existing.labels.get(LABEL_ROLE) != host.role:
        raise OperationError(
            f"{host.address}: a container named {name} exists that this cluster did not start",
            f"remove or rename it on {host.address} (docker rm -f {name}) if it is not needed",
        )
    if existing.running and not force and _same_image(transport, existing.id, inventory.image):
        return "running"
    return "restart"


def _apply_node(transport: Transport, inventory: Inventory, host: HostConfig, plan: str) -> str:
    """Carry out a plan of `_plan_node`; return the action taken (running / started / restarted)."""
    if plan == "running":
        return "running"
    if plan == "restart":
        transport.run("docker rm -f " + quote(container_name(inventory, host)))
    result = transport.run(docker_run_command(inventory, host), timeout=120)
    if not result.ok:
        raise OperationError(
            f"{host.address}: docker run failed: {result.first_line()}",
            "check the image and docker.run_options in the inventory",
        )
    return "started" if plan == "start" else "restarted"


def _same_image(transport: Transport, container_id: str, image: str) -> bool:
    """Whether the container runs the image ID that the inventory's image name points to now."""
    ids = transport.run(
        f"docker inspect --format '{{{{.Image}}}}' {quote(container_id)} && "
        f"docker image inspect --format '{{{{.Id}}}}' {quote(image)}"
    ).stdout.split()
    return len(ids) == 2 and ids[0] == ids[1]


def _wait_head(transport: Transport, inventory: Inventory, timeout_s: float) -> None:
    name = container_name(inventory, inventory.head_host)
    address = f"{inventory.head_address}:{inventory.ray.port}"
    deadline = time.monotonic() + timeout_s
    while True:
        state = parse_ps(transport.run(inspect_name_command(name)).stdout)
        if not state or not state[0].running:
            raise OperationError(
                f"{inventory.head_host.address}: the head container exited: {_tail(transport, name)}",
                f"see `docker logs {name}` on {inventory.head_host.address}",
            )
        check = transport.run(f"docker exec {quote(name)} ray health-check --address {quote(address)}", timeout=60)
        if check.ok:
            return
        if time.monotonic() > deadline:
            raise OperationError(
                f"{inventory.head_host.address}: the head's GCS did not answer within {timeout_s:.0f}s",
                f"see `docker logs {name}` on {inventory.head_host.address}",
            )
        time.sleep(1.0)


def _probe(
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


def _tail(transport: Transport, name: str, lines: int = 3) -> str:
    out = transport.run(f"docker logs --tail {lines} {quote(name)} 2>&1")
    return " | ".join(line.strip() for line in out.stdout.splitlines() if line.strip())[-300:] or "(no log)"


def _log_tail(connect: Connect, inventory: Inventory, host: HostConfig) -> str:
    try:
        return _tail(connect(host), container_name(inventory, host))
    except RayclusterError as exc:
        return exc.message


@dataclass
class DownResult:
    removed: list[dict[str, str]]
    errors: list[dict[str, str]]

    @property
    def ok(self) -> bool:
        return not self.errors


def down(inventory: Inventory, connect: Connect, *, progress: Progress = _quiet) -> DownResult:
    """Remove this cluster's labelled containers: workers in parallel first, then the head."""
    removed: list[dict[str, str]] = []
    errors: list[dict[str, str]] = []

    def remove_on(host: HostConfig) -> list[str]:
        transport = connect(host)
        names = []
        for container in list_cluster_containers(transport, inventory):
            result = transport.run("docker rm -f " + quote(container.id), timeout=120)
            if not result.ok:
                raise OperationError(
                    f"{host.address}: cannot remove {container.name}: {result.first_line()}",
                    "check Docker there",
                )
            names.append(container.name)
        return names

    for group in (inventory.workers, [inventory.head_host]):
        for host, outcome in fanout(group, remove_on):
            if outcome.error is not None:
                message = outcome.error.one_line() if isinstance(outcome.error, RayclusterError) else str(outcome.error)
                errors.append({"host": str(host.address), "error": message})
            for name in outcome.value or []:
                progress(f"removed {name} on {host.address}")
                removed.append({"host": str(host.address), "container": name})
    return DownResult(removed, errors)


def bench(inventory: Inventory, connect: Connect, driver_args: list[str], timeout_s: float = 900.0) -> dict[str, Any]:
    """Run the benchmark driver inside the head's container; map each stage's node IP to its host."""
    head = inventory.head_host
    transport = connect(head)
    name = container_name(inventory, head)
    state = parse_ps(transport.run(inspect_name_command(name)).stdout)
    if not state or not state[0].running:
        raise OperationError(f"{head.address}: the cluster's head is not running", "start the cluster: raycluster up")
    command = f"docker exec {quote(name)} python -m raycluster_cli.bench.driver " + quote(*driver_args)
    result = transport.run(command.strip(), timeout=timeout_s)
    try:
        document: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise OperationError(
            f"{head.address}: the benchmark produced no result: {result.first_line()}", "run with --debug"
        ) from None
    if not document.get("ok"):
        raise OperationError(f"benchmark failed: {document.get('error', 'unknown error')}", "see the message")
    host_of = {inventory.node_ip(h): str(h.address) for h in inventory.hosts}
    for item in [*document.get("stages", []), *document.get("calibration", {}).get("nodes", [])]:
        item["host"] = host_of.get(item.get("node_ip", ""), item.get("node_ip", "?"))
    extra = [document.get("references", {}).get("unsharded", {}), *document.get("replicas", [])]
    for item in [*extra, *document.get("sweep", {}).get("points", [])]:
        if "node_ip" in item:
            item["host"] = host_of.get(item["node_ip"], item["node_ip"])
        if "node_ips" in item:
            item["hosts"] = [host_of.get(ip, ip) for ip in item["node_ips"]]
    return document
