"""Cluster lifecycle: up (the head, every worker in parallel while it starts, wait until all joined).

The phases are the methods of `up_phases.UpRun`: preflight, deliver_image, plan, start_head, start_workers, wait.

Never prints: progress goes through the callback the caller gives.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from raycluster_cli.checks import CheckResult
from raycluster_cli.config.inventory import Inventory
from raycluster_cli.delivery.deliver import ImageTransfer
from raycluster_cli.errors import RayclusterError
from raycluster_cli.progress import Progress, quiet
from raycluster_cli.transport.pool import Connect
from raycluster_cli.verbs import served_model
from raycluster_cli.verbs.up_hosts import NodesMissing, PreflightFailed
from raycluster_cli.verbs.up_phases import UpRun

__all__ = ["NodeState", "NodesMissing", "PreflightFailed", "UpResult", "up", "without_auth"]


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
        return asdict(self)


@dataclass
class UpResult:
    inventory: Inventory
    nodes: list[NodeState]
    checks: list[CheckResult]
    seconds: float
    images: list[ImageTransfer] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    service_grown: list[int] | None = None  # pipelines the running service built over the nodes started now

    @property
    def ok(self) -> bool:
        return all(n.alive for n in self.nodes)

    @property
    def head(self) -> str:
        return self.inventory.head_address

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.inventory.head_address}:{self.inventory.ray.dashboard_port}"


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
    """Checks → image where missing → token and env files → head → workers in parallel (while the head starts)
    → wait for all.

    Named phases over one record per host (up_phases.py). Idempotent: a node whose container already
    runs as the inventory asks is kept; one of ours that differs is replaced and its NodeState says why.
    Raises PreflightFailed on a failing check and NodesMissing naming each node that did not join.
    """
    started = time.monotonic()
    if insecure:
        inventory = without_auth(inventory)
    warnings = [INSECURE_WARNING.format(head=inventory.head_address)] if inventory.ray.auth == "none" else []
    run = UpRun(inventory, connect, progress, timeout_s, ignore)
    run.preflight()
    run.deliver_image()
    run.plan()
    run.start_head()
    run.start_workers()
    run.wait()
    nodes = [
        NodeState(r.address, r.role, r.node_ip, r.alive, r.action, r.resources, r.reason) for r in run.runs.values()
    ]
    result = UpResult(inventory, nodes, run.checks, time.monotonic() - started, run.images, warnings)
    result.service_grown = tell_service(run, connect, progress, result.warnings)
    result.seconds = time.monotonic() - started
    return result


def tell_service(run: UpRun, connect: Connect, progress: Progress, warnings: list[str]) -> list[int] | None:
    """A running service takes in the workers started now (added to the inventory, or back after `down --host`)
    at once, rather than at its next periodic look.  Only when the head was kept (a new head has no service) and
    some worker started; a service that cannot be told is a warning: the cluster itself is up."""
    from raycluster_cli.verbs.drain import take_in

    started = [r.host for r in run.workers if r.alive and r.action != "running"]
    if run.head.action != "running" or not started:
        return None
    progress(f"telling the service of {len(started)} node(s) started now")
    try:
        problem = served_model.relay_to_new_hosts(run.inventory, connect, progress)  # a new host lacks the model
        if problem is not None:
            warnings.append(problem)
        return take_in(run.inventory, connect, started)
    except RayclusterError as exc:
        warnings.append(f"the service was not told of the new node(s): {exc.one_line()}; it takes them in by itself")
        return None
