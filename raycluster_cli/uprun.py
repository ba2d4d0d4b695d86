"""`up` as named phases over one record per host (Ray's NodeUpdater keeps one such record per node).

preflight → deliver_image → plan → start_head → start_workers → wait. The preflight gathers, in one remote
command per host, every fact the checks judge and the later phases read (the container there, the image ID,
the NICs); each phase then moves each host's `HostRun` along: checking → checked → (receiving) → starting →
waiting → joined, or failed with why, every change reported as a `HostPhase` progress event. A worker costs
two remote commands when nothing goes wrong: the gather, and one command that writes its files and starts its
container.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .checks import CheckResult, Status, run_checks
from .checks.catalog import ALL_CHECKS, IMAGE_ID, IMAGE_RUNTIME, IP_ADDR
from .containers import env_file_content, env_path_on_host, token_path_on_host
from .engine import image_id
from .errors import OperationError, RayclusterError
from .facts import FactCache
from .images import ImageTransfer, demote_fixed_checks, distribute, local_image_id, plan_transfers, remote_image_ids
from .inventory import HostConfig, Inventory
from .nodes import CONTAINER, Plan, files_digest, node_env, plan_node
from .progress import HostPhase, Phase, Progress
from .state import ensure_token, state_dir
from .transport.fanout import error_message
from .transport.pool import Connect

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


class UpRun:
    """The state of one `up`: the hosts' records, the facts cache, the checks, the image transfers."""

    def __init__(
        self, inventory: Inventory, connect: Connect, progress: Progress, timeout_s: float, ignore: frozenset[str]
    ) -> None:
        self.inventory = inventory
        self.connect = connect
        self.progress = progress
        self.timeout_s = timeout_s
        self.ignore = ignore
        self.cache = FactCache(inventory, connect)
        self.runs = {str(h.address): HostRun(h, inventory.node_ip(h)) for h in inventory.hosts}
        self.checks: list[CheckResult] = []
        self.transfers: list[ImageTransfer] = []
        self.images: list[ImageTransfer] = []
        self.local_id: str | None = None
        self.token: bytes | None = None
        self.stale: list[str] = []  # node IDs of replaced workers the head's GCS may still list as alive
        self.nodes: list[dict[str, Any]] = []  # the GCS's node list, as last read

    @property
    def head(self) -> HostRun:
        return self.runs[str(self.inventory.head_host.address)]

    @property
    def workers(self) -> list[HostRun]:
        return [r for r in self.runs.values() if r.role == "worker"]

    def move(self, run: HostRun, phase: Phase, detail: str = "") -> None:
        """Move a host to `phase` and report it (with how many nodes joined so far)."""
        if (run.phase, run.detail) == (phase, detail):
            return
        run.phase, run.detail = phase, detail
        joined = sum(r.alive for r in self.runs.values())
        self.progress(HostPhase(run.address, run.role, phase, detail, joined, len(self.runs)))

    def fail(self, runs: list[HostRun], error: BaseException) -> None:
        for run in runs:
            self.move(run, "failed", error_message(error, run.address))

    # -- preflight ------------------------------------------------------------------------------------

    def preflight(self) -> None:
        """Every check on every host, judged from one gather that also reads what the later phases need."""
        for run in self.runs.values():
            self.progress(HostPhase(run.address, run.role, "checking", "", 0, len(self.runs)))
        self.progress("running preflight checks")
        checks = run_checks(
            self.inventory,
            self.connect,
            ignore=self.ignore,
            cache=self.cache,
            also=lambda ctx: [CONTAINER, IP_ADDR, IMAGE_ID],
        )
        if any(r.id == "ssh" and r.status == Status.FAIL for r in checks):
            self._refuse(checks)  # an unreachable host: its SSH failure is the cause, not its image
        if self.inventory.image_source == "stream":
            self.local_id = local_image_id(self.inventory.image)
        self.transfers = plan_transfers(self.inventory, self.local_id, remote_image_ids(checks))
        self.checks = demote_fixed_checks(checks, self.transfers)
        self._refuse(self.checks)
        for run in self.runs.values():
            self.move(run, "checked")

    def _refuse(self, checks: list[CheckResult]) -> None:
        """Raise PreflightFailed when a check failed, each such host marked failed with its first failure."""
        failed = [r for r in checks if r.status == Status.FAIL]
        for result in failed:
            run = self.runs.get(result.host)
            if run is not None and run.phase != "failed":
                self.move(run, "failed", f"{result.id}: {result.message}")
        if failed:
            raise PreflightFailed(checks)

    # -- image ------------------------------------------------------------------------------------------

    def deliver_image(self) -> None:
        """Stream (or pull) the image to every host that lacks it; check what arrived like any other image."""
        if not self.transfers:
            return
        for transfer in self.transfers:
            self.move(self.runs[transfer.host], "receiving", f"image {transfer.reason}")
            self.progress(f"{transfer.host}: image {transfer.reason}: {transfer.method}ing it")
        archive_dir = state_dir(self.inventory) / "images"
        try:
            self.images = distribute(
                self.inventory, self.connect, self.transfers, self.local_id, archive_dir, self.progress
            )
        except RayclusterError as exc:
            self.fail([self.runs[t.host] for t in self.transfers], exc)
            raise
        fixed = {t.host for t in self.transfers}
        runtime = [c for c in ALL_CHECKS if c.id == "image-runtime"]
        again = run_checks(
            self.inventory,
            self.connect,
            runtime,
            self.ignore,
            hosts=fixed,
            cache=self.cache,
            also=lambda ctx: [CONTAINER, IMAGE_ID],
            refresh=[IMAGE_RUNTIME, IMAGE_ID, CONTAINER],  # the new image's ID decides what runs there
        )
        again = [r for r in again if r.id == "image-runtime"]
        self.checks = [r for r in self.checks if not (r.id == "image-runtime" and r.host in fixed)] + again
        self._refuse(self.checks)
        for host in fixed:
            self.move(self.runs[host], "checked", "image received")

    # -- plan ---------------------------------------------------------------------------------------------

    def plan(self) -> None:
        """Token, each host's env file and what to do with its container: all from the gathered facts."""
        unreachable = [r for r in self.runs.values() if self.cache.error(r.host) is not None]
        for run in unreachable:  # its ssh failure was ignored, but it cannot be started
            self.fail([run], self.cache.error(run.host) or RuntimeError("unreachable"))
        if unreachable:
            raise self.cache.error(unreachable[0].host) or RuntimeError("unreachable")
        self.token = ensure_token(self.inventory) if self.inventory.ray.auth == "token" else None
        for run in self.runs.values():
            addr = self.cache.of(run.host).result(IP_ADDR)
            run.env = env_file_content(node_env(self.inventory, run.host, addr.stdout if addr.ok else ""))
            run.digest = files_digest(run.env, self.token)
        self.head.plan = self._plan(self.head, "")
        force = "" if self.head.plan.action == "keep" else "the head was replaced"  # every worker must join it
        errors: list[OperationError] = []
        for run in self.workers:
            try:
                run.plan = self._plan(run, force)
            except OperationError as exc:
                self.fail([run], exc)
                errors.append(exc)
        if errors:
            raise errors[0]
        for run in self.runs.values():
            run.reason = run.plan.reason

    def _plan(self, run: HostRun, force: str) -> Plan:
        facts = self.cache.of(run.host)
        image = facts.result(IMAGE_ID)
        now = image_id(image.stdout) if image.ok else ""
        return plan_node(self.inventory, run.host, facts.get(CONTAINER), now, run.digest, force)

    def files(self, run: HostRun) -> dict[str, bytes]:
        """What the host's container reads at start: its env file and, with token auth, the token."""
        files = {env_path_on_host(self.inventory, run.host): run.env}
        if self.token is not None:
            files[token_path_on_host(self.inventory, run.host)] = self.token
        return files
