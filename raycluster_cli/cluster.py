"""Cluster lifecycle: up (head first, then workers in parallel, wait until all joined).

Never prints: progress goes through the callback the caller gives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .checks import CheckResult, Status, run_checks
from .checks.catalog import ALL_CHECKS
from .containers import (
    container_name,
    inspect_name_command,
    parse_ps,
    token_path_on_host,
)
from .diagnose import diagnose, gather
from .errors import OperationError, RayclusterError
from .hoststate import make_dir
from .images import ImageTransfer, demote_fixed_checks, distribute, local_image_id, plan_transfers, remote_image_ids
from .inventory import HostConfig, Inventory
from .nodes import Plan, apply, files_digest, plan_node, prepare, probe, wait_head
from .progress import Progress, quiet
from .state import ensure_token, state_dir
from .transport.fanout import error_message, fanout
from .transport.pool import Connect

_HOSTS_NAMED = 20  # in the one-line message; --json lists every check


class PreflightFailed(RayclusterError):
    def __init__(self, results: list[CheckResult]) -> None:
        failed = [r for r in results if r.status == Status.FAIL]
        by_host: dict[str, list[CheckResult]] = {}
        for result in failed:
            by_host.setdefault(result.host, []).append(result)
        shown = [
            f"{host} {found[0].id}: {found[0].message}" + (f" (+{len(found) - 1} more)" if len(found) > 1 else "")
            for host, found in list(by_host.items())[:_HOSTS_NAMED]
        ]
        more = f"; and {len(by_host) - _HOSTS_NAMED} more host(s)" if len(by_host) > _HOSTS_NAMED else ""
        super().__init__(
            f"{len(failed)} preflight check(s) failed on {len(by_host)} host(s): " + "; ".join(shown) + more,
            "run `raycluster doctor` for all of them, fix them, or pass --ignore ID",
        )
        self.results = results


@dataclass
class NodeState:
    host: str
    role: str
    node_ip: str
    alive: bool
    action: str = ""  # started / running / restarted
    resources: dict[str, float] = field(default_factory=dict)
    reason: str = ""  # why a container was replaced

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "role": self.role,
            "node_ip": self.node_ip,
            "alive": self.alive,
            "action": self.action,
            "reason": self.reason,
            "resources": self.resources,
        }


@dataclass
class UpResult:
    inventory: Inventory
    nodes: list[NodeState]
    checks: list[CheckResult]
    seconds: float
    images: list[ImageTransfer] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(n.alive for n in self.nodes)

    @property
    def head(self) -> str:
        return self.inventory.head_address

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.inventory.head_address}:{self.inventory.ray.dashboard_port}"


class NodesMissing(OperationError):
    """Some nodes did not join: one diagnosis (and log tail) per missing host in `details`."""

    def __init__(self, message: str, hint: str, details: list[dict[str, Any]], joined: list[str] | None = None) -> None:
        super().__init__(message, hint)
        self.details = details
        self.joined = joined or []  # the hosts whose nodes did join


INSECURE_WARNING = (
    "Ray token authentication is OFF: anyone who reaches the head's ports ({head}) can run code on every "
    "node; use it only on a trusted, isolated network"
)


def without_auth(inventory: Inventory) -> Inventory:
    """The inventory with ray.auth: none (for `up --insecure`)."""
    return inventory.model_copy(update={"ray": inventory.ray.model_copy(update={"auth": "none"})})


def up(
    inventory: Inventory,
    connect: Connect,
    *,
    ignore: frozenset[str] = frozenset(),
    timeout_s: float = 180.0,
    insecure: bool = False,
    progress: Progress = quiet,
) -> UpResult:
    """Checks → image where missing → token and env files → head → workers in parallel → wait for all.

    Idempotent: a node whose container already runs as the inventory asks is kept; one of ours that
    differs is replaced and its NodeState says why. Raises NodesMissing naming each node that did not join.
    """
    started = time.monotonic()
    if insecure:
        inventory = without_auth(inventory)
    warnings = [INSECURE_WARNING.format(head=inventory.head_address)] if inventory.ray.auth == "none" else []
    progress("running preflight checks")
    checks = run_checks(inventory, connect, ignore=ignore)
    if any(r.id == "ssh" and r.status == Status.FAIL for r in checks):
        raise PreflightFailed(checks)  # an unreachable host: its SSH failure is the cause, not its image
    local_id = local_image_id(inventory.image) if inventory.image_source == "stream" else None
    transfers = plan_transfers(inventory, local_id, remote_image_ids(checks))
    checks = demote_fixed_checks(checks, transfers)
    if any(r.status == Status.FAIL for r in checks):
        raise PreflightFailed(checks)
    for transfer in transfers:
        progress(f"{transfer.host}: image {transfer.reason}: {transfer.method}ing it")
    images = distribute(inventory, connect, transfers, local_id, state_dir(inventory) / "images", progress)
    if transfers:
        checks = _recheck_image_runtime(inventory, connect, checks, {t.host for t in transfers}, ignore)
    token = ensure_token(inventory) if inventory.ray.auth == "token" else None
    folders = fanout(inventory.hosts, lambda h: make_dir(connect(h), inventory, h), what="make the host state folders")
    folders.raise_failures()
    if token is not None:
        put_token = fanout(
            inventory.hosts, lambda h: connect(h).put(token, token_path_on_host(inventory, h)), what="write the token"
        )
        put_token.raise_failures()
    envs = fanout(inventory.hosts, lambda h: prepare(connect(h), inventory, h), what="write the env files")
    envs.raise_failures()
    env_of = {str(h.address): files_digest(o.value or b"", token) for h, o in envs}
    head = inventory.head_host
    head_transport = connect(head)
    head_plan = plan_node(head_transport, inventory, head, env_of[str(head.address)])
    progress(
        f"head on {head.address}: " + (head_plan.reason or {"keep": "running", "start": "starting"}[head_plan.action])
    )
    head_action = apply(head_transport, inventory, head, head_plan)
    wait_head(head_transport, inventory, timeout_s)
    progress(f"head ready; {len(inventory.workers)} worker(s) next")
    force = "" if head_action == "running" else "the head was replaced"  # every worker must join the new head
    plans = fanout(
        inventory.workers,
        lambda h: plan_node(connect(h), inventory, h, env_of[str(h.address)], force),
        what="inspect the worker containers",
    )
    plans.raise_failures()
    plan_of = {str(h.address): o.value or Plan("start") for h, o in plans}
    replaced = {inventory.node_ip(h) for h in inventory.workers if plan_of[str(h.address)].action != "keep"}
    # With the head kept, nodes of workers about to be replaced may linger in its GCS: note their IDs.
    before = probe(head_transport, inventory, [], 0) if replaced and not force else []
    stale = [n["node_id"] for n in before if n["alive"] and n["node_ip"] in replaced]
    for address, plan in plan_of.items():
        if plan.reason:
            progress(f"{address}: replacing the worker container: {plan.reason}")
    actions = fanout(
        inventory.workers, lambda h: apply(connect(h), inventory, h, plan_of[str(h.address)]), what="start the workers"
    )
    actions.raise_failures()
    progress("waiting for every node to join")
    expected = {inventory.node_ip(h): h for h in inventory.hosts}
    reported, retried = _wait_nodes(inventory, connect, sorted(expected), stale, timeout_s, progress)
    alive = {n["node_ip"]: n for n in reported if n["alive"] and n["node_id"] not in stale}
    action_of = {str(head.address): head_action} | {str(h.address): o.value or "" for h, o in actions}
    reason_of = {str(head.address): head_plan.reason} | {a: p.reason for a, p in plan_of.items()}
    for address in retried:
        action_of[address] = "restarted"
        reason_of[address] = "; ".join(filter(None, [reason_of.get(address, ""), RETRIED]))
    nodes = [
        NodeState(
            str(h.address),
            h.role,
            ip,
            ip in alive,
            action_of.get(str(h.address), ""),
            alive.get(ip, {}).get("resources", {}),
            reason_of.get(str(h.address), ""),
        )
        for ip, h in expected.items()
    ]
    missing = [h for h in inventory.hosts if inventory.node_ip(h) not in alive]
    if missing:
        raise _missing_error(inventory, connect, missing, reported, timeout_s)
    return UpResult(inventory, nodes, checks, time.monotonic() - started, images, warnings)


def _recheck_image_runtime(
    inventory: Inventory, connect: Connect, checks: list[CheckResult], fixed: set[str], ignore: frozenset[str]
) -> list[CheckResult]:
    """The image `up` just delivered is checked for its Ray and Python versions like any other host's."""
    runtime = [c for c in ALL_CHECKS if c.id == "image-runtime"]
    again = [r for r in run_checks(inventory, connect, runtime, ignore, hosts=fixed) if r.id == "image-runtime"]
    checks = [r for r in checks if not (r.id == "image-runtime" and r.host in fixed)] + again
    if any(r.status == Status.FAIL for r in again):
        raise PreflightFailed(checks)
    return checks


RETRIED = "its container exited while starting: started once more"
_ENDED = ("exited", "dead")  # container states of a node that will not join by itself
_POLL_S = 20.0
_PROBE_RETRIES = 2  # a node list the head could not give is asked again this often
_PROBE_PAUSE_S = 2.0


def _wait_nodes(
    inventory: Inventory,
    connect: Connect,
    expected: list[str],
    stale: list[str],
    timeout_s: float,
    progress: Progress,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Wait until every expected node is alive; start once more a worker whose container exited meanwhile.

    Ray gives a starting worker's raylet a fixed 30 s to register, which a loaded host can miss; a second
    start usually joins. Stops early when every missing worker's container exited after its second start.
    Returns the head's node list and the addresses started once more.
    """
    head = connect(inventory.head_host)
    deadline = time.monotonic() + timeout_s
    retried: list[str] = []
    unreadable = 0
    while True:
        window = max(0.0, min(_POLL_S, deadline - time.monotonic()))
        try:
            nodes = probe(head, inventory, expected, window, stale)
        except OperationError as exc:
            # A driver a loaded head's raylet drops while registering ("Failed to register worker to Raylet")
            # is transient: ask again a few times within the deadline, then report it.
            unreadable += 1
            if unreadable > _PROBE_RETRIES or time.monotonic() >= deadline:
                raise
            progress(f"{exc.message}; asking the head again")
            time.sleep(_PROBE_PAUSE_S)
            continue
        alive = {n["node_ip"] for n in nodes if n["alive"] and n["node_id"] not in stale}
        ghosts = any(n["alive"] and n["node_id"] in stale for n in nodes)
        if (set(expected) <= alive and not ghosts) or time.monotonic() >= deadline:
            return nodes, retried
        missing = [h for h in inventory.workers if inventory.node_ip(h) not in alive]
        states = fanout(
            missing, lambda h: parse_ps(connect(h).run(inspect_name_command(container_name(inventory, h))).stdout)
        )
        # (a paused container is frozen, not exited: it is waited for, never replaced)
        exited = [h for h, o in states if o.value and o.value[0].state in _ENDED]
        fresh = [h for h in exited if str(h.address) not in retried]
        if missing and not fresh and len(exited) == len(missing):
            return nodes, retried
        for host in fresh:
            progress(f"{host.address}: the worker container exited while starting; starting it once more")
            retried.append(str(host.address))
        # A host that fails its restart (it froze meanwhile) stays missing: the wait goes on for the others,
        # and the missing-nodes error names it with its cause.
        fanout(fresh, lambda h: apply(connect(h), inventory, h, Plan("replace")), what="restart workers")


def _missing_error(
    inventory: Inventory, connect: Connect, missing: list[HostConfig], nodes: list[dict[str, Any]], timeout_s: float
) -> NodesMissing:
    """Name each host whose node did not join, with its log tail and the likely cause."""
    found = fanout(missing, lambda h: gather(connect(h), inventory, h), what="diagnose the missing nodes")
    found.check_interrupted()
    details: list[dict[str, Any]] = []
    unreachable: list[str] = []  # the fix for a host that could not even be asked (frozen, cut off)
    for host, outcome in found:
        if outcome.value is None:
            reason = error_message(outcome.error or RuntimeError("no result"), str(host.address))
            details.append({"host": str(host.address), "cause": f"{host.address}: {reason}", "log_tail": []})
            unreachable.append(f"{host.address}: {getattr(outcome.error, 'hint', '') or 'check the host'}")
            continue
        cause = diagnose(inventory, host, outcome.value, nodes, len(missing))
        details.append({"host": str(host.address), "cause": cause, "log_tail": outcome.value.log_tail})
    first = missing[0]
    hint = (
        f"{unreachable[0]}; then re-run `raycluster up`"
        if len(unreachable) == len(missing)
        else f"see `docker logs {container_name(inventory, first)}` on {first.address} (tail below), fix the cause, "
        "re-run `raycluster up`"
    )
    return NodesMissing(
        f"{len(missing)} node(s) did not join within {timeout_s:.0f}s: " + "; ".join(str(d["cause"]) for d in details),
        hint,
        details,
        [str(h.address) for h in inventory.hosts if h not in missing],
    )
