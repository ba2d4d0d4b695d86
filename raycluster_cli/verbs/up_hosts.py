"""What `up` knows of each host (one `HostRun` record per host, as Ray's NodeUpdater keeps one per node) and the
errors that name the hosts: a failed preflight, nodes that did not join."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raycluster_cli.checks import CheckResult, Status
from raycluster_cli.config.inventory import HostConfig
from raycluster_cli.errors import OperationError, RayclusterError
from raycluster_cli.host.node import Plan
from raycluster_cli.progress import Phase

RETRIED = "its container exited while starting: started once more"
RETRIED_KEPT = "its running container exited while up waited: started once more"
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


class NodesMissing(OperationError):
    """Some nodes did not join: one diagnosis (and log tail) per missing host in `details`."""

    def __init__(self, message: str, hint: str, details: list[dict[str, Any]], joined: list[str] | None = None) -> None:
        super().__init__(message, hint)
        self.details = details
        self.joined = joined or []  # the hosts whose nodes did join


@dataclass
class HostRun:
    """One host through one `up`: its phase, the env file it gets, what `up` decided and did there."""

    host: HostConfig
    node_ip: str
    phase: Phase = "checking"
    detail: str = ""
    env: bytes = b""
    digest: str = ""
    plan: Plan = field(default_factory=lambda: Plan("start"))
    action: str = ""  # running / started / restarted
    reason: str = ""  # why its container was replaced
    resources: dict[str, float] = field(default_factory=dict)
    retried: bool = False  # started once more after its container exited while starting

    @property
    def address(self) -> str:
        return str(self.host.address)

    @property
    def role(self) -> str:
        return self.host.role

    @property
    def alive(self) -> bool:
        return self.phase == "joined"

    def restarted(self) -> None:
        """Its container exited while starting (Ray's fixed 30 s to register), or a container `up` found running
        exited while `up` waited: it is started once more."""
        why = RETRIED_KEPT if self.plan.action == "keep" else RETRIED
        self.retried = True
        self.plan = Plan("replace")
        self.reason = "; ".join(filter(None, [self.reason, why]))
