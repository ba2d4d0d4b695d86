"""`up` as named phases over one record per host (Ray's NodeUpdater keeps one such record per node).

preflight → deliver_image → plan → start_head → start_workers → wait, all methods of `UpRun`. The preflight
gathers, in one remote command per host, every fact the checks judge and the later phases read (the container
there, the image ID, the NICs); each phase then moves each host's `HostRun` (up_hosts.py) along: checking →
checked → (receiving) → starting → waiting → joined, or failed with why, every change reported as a
`HostPhase` progress event. A worker costs two remote commands when nothing goes wrong before the wait: the
gather, and one command that writes its files and starts its container.

Each node's own container log says when Ray registered it (`ray start` prints "Ray runtime started." only once
the GCS knows the node): `up` watches that on each host with one remote command that runs nothing but docker's
CLI, so no Python start-up competes with a starting node. The head's container starts first and every
worker's right after it, without waiting: a worker's container waits until the head's GCS answers before its
`ray start` (containers.start_script), and then, unless the inventory gives the head and the worker different
temp folders, starts its Ray without waiting for the head's node to register (Ray's own `ray start` would: the
head registers last, after its dashboard, raylet and agents). So the workers' containers, their imports and
their whole Ray start overlap the head's start. One look at the GCS (up_look.py) waits for every node to be
alive while the registrations are watched.
"""

from __future__ import annotations

import time
from typing import Any

from raycluster_cli.checks import CheckResult, Status, run_checks
from raycluster_cli.checks.catalog import ALL_CHECKS, IMAGE_ID, IMAGE_RUNTIME, IP_ADDR
from raycluster_cli.checks.cross import demote_fixed_image_checks, image_ids_found
from raycluster_cli.config.inventory import Inventory
from raycluster_cli.config.state import ensure_token, state_dir
from raycluster_cli.delivery.deliver import ImageTransfer, distribute, local_image_id, plan_transfers
from raycluster_cli.errors import OperationError, RayclusterError
from raycluster_cli.host.containers import container_name, env_file_content, env_path_on_host, token_path_on_host
from raycluster_cli.host.diagnose import EVIDENCE, diagnose
from raycluster_cli.host.engine import image_id
from raycluster_cli.host.facts import FactCache
from raycluster_cli.host.node import (
    CONTAINER,
    EXITED,
    Plan,
    apply,
    files_digest,
    node_env,
    plan_node,
    probe,
    start_failure,
    token_digest,
    wait_started,
)
from raycluster_cli.progress import HostPhase, Phase, Progress
from raycluster_cli.transport.fanout import error_message, fanout
from raycluster_cli.transport.pool import Connect
from raycluster_cli.verbs.up_hosts import HostRun, NodesMissing, PreflightFailed
from raycluster_cli.verbs.up_look import Gcs, Look, early_look, read_nodes


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
        self.transfers = plan_transfers(self.inventory, self.local_id, image_ids_found(checks))
        verb = "streams" if self.inventory.image_source == "stream" else "pulls"
        self.checks = demote_fixed_image_checks(checks, {t.host for t in self.transfers}, verb)
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
        mine = token_digest(self.token)
        return plan_node(self.inventory, run.host, facts.get(CONTAINER), now, run.digest, force, mine)

    def files(self, run: HostRun) -> dict[str, bytes]:
        """What the host's container reads at start: its env file and, with token auth, the token."""
        files = {env_path_on_host(self.inventory, run.host): run.env}
        if self.token is not None:
            files[token_path_on_host(self.inventory, run.host)] = self.token
        return files

    # -- head, workers, wait ---------------------------------------------------------------------------

    def start_head(self) -> None:
        """Start (or keep) the head's container; `wait` waits for its node (the workers start meanwhile)."""
        head = self.head
        replaced = {r.node_ip for r in self.workers if r.plan.action != "keep"}
        if head.plan.action == "keep" and replaced:
            # The head stays: nodes of workers about to be replaced may linger in its GCS: note their IDs.
            before = probe(self.connect(head.host), self.inventory, [], 0)
            self.stale = [n["node_id"] for n in before if n["alive"] and n["node_ip"] in replaced]
        for each in self.runs.values():
            if each.reason:
                self.progress(f"{each.address}: replacing the {each.role} container: {each.reason}")
        self._start(head)
        if self.workers:
            self.progress(f"head starting; {len(self.workers)} worker(s) start now and join once its GCS answers")

    def start_workers(self) -> None:
        """Write each worker's files and start (or keep) its container, all at once: one remote command each."""
        fanout(self.workers, lambda w: self._start(w), what="start the workers").raise_failures()

    def _start(self, host: HostRun) -> None:
        """Write the host's files and start (or keep) its container: one remote command."""
        keep = host.plan.action == "keep"
        self.move(host, "starting", host.reason or ("its container runs as asked" if keep else ""))
        try:
            host.action = apply(self.connect(host.host), self.inventory, host.host, host.plan, self.files(host))
        except Exception as exc:
            self.fail([host], exc)
            raise
        self.move(host, "waiting", "for its Ray node to register")

    def _until_registered(self, host: HostRun, deadline: float) -> OperationError | None:
        """Wait until the host's node is registered; a container that exits while starting is started once more
        (Ray gives a starting node a fixed 30 s to register, which a loaded host can miss), and so is one that `up`
        found running and kept but that exited before its wait (a head that outlived a long freeze can exit a few
        seconds after it; its workers then join the new head: `wait`). The error if not."""
        while True:
            timeout_s = max(0.0, deadline - time.monotonic())
            result = wait_started(self.connect(host.host), self.inventory, host.host, timeout_s)
            if result.ok:
                self.move(host, "waiting", "registered; the head's GCS is asked")
                return None
            if result.rc != EXITED or host.retried or time.monotonic() >= deadline:
                error = start_failure(self.inventory, host.host, result, self.timeout_s)
                self.move(host, "failed", error_message(error, host.address))
                return error
            when = (
                ", found running, exited before up waited for it"
                if host.plan.action == "keep"
                else " exited while starting"
            )
            self.progress(f"{host.address}: the {host.role} container{when}; starting it once more")
            host.restarted()
            self._start(host)

    def wait(self) -> None:
        """Until the head's node is registered, then every worker registered (each seen on its host) and every
        node alive in the head's GCS (asked meanwhile).

        Raises the head's start failure, or NodesMissing naming each node that did not join, with why (its
        container's state and log).
        """
        self.progress("waiting for every node to join")
        deadline = time.monotonic() + self.timeout_s
        expected = sorted(r.node_ip for r in self.runs.values())
        gcs = Gcs(self.inventory, self.connect, self.head, self.stale, self.progress)
        early = early_look(gcs, self.workers, expected, deadline)
        error = self._until_registered(self.head, deadline)
        if error is not None:
            if early is not None:
                early.cancel()
            for worker in self.workers:
                self.move(worker, "failed", f"the head at {self.head.address} did not start")
            raise error
        if self.head.retried and self.workers:  # the workers that met the first head's GCS join the second one
            if early is not None:  # its container is replaced: the head is asked instead
                early.cancel()
                early = None
            for worker in self.workers:
                worker.plan = Plan("replace", "the head was started once more")
                worker.reason = "; ".join(filter(None, [worker.reason, worker.plan.reason]))
            self.start_workers()
        look = early or Look(gcs, expected, deadline, self.head)
        waited = fanout(self.workers, lambda w: self._until_registered(w, deadline), what="wait for the workers")
        waited.check_interrupted()  # the look ends by its own deadline: no remote command runs after an interrupt
        for worker, failure in waited.failed:
            self.move(worker, "failed", error_message(failure, worker.address))
        registered = [r for r in self.runs.values() if r.phase != "failed"]
        if len(registered) == len(self.runs):
            self.nodes = look.result()
        else:
            look.cancel()
            self.nodes = read_nodes(gcs, sorted(r.node_ip for r in registered), deadline)
        alive = {n["node_ip"]: n for n in self.nodes if n["alive"] and n["node_id"] not in self.stale}
        for host in registered:
            if host.node_ip in alive:
                host.resources = alive[host.node_ip].get("resources", {})
                self.move(host, "joined", host.action)
        missing = [r for r in self.runs.values() if not r.alive]
        if missing:
            raise self._missing_error(missing)

    def _missing_error(self, missing: list[HostRun]) -> NodesMissing:
        """Name each host whose node did not join, with its log tail and the likely cause; the hint is the fix of
        the hosts that could not even be asked (frozen, cut off) when every missing host is such a one."""
        self.cache.gather([r.host for r in missing], lambda ctx: [EVIDENCE], refresh=[EVIDENCE])
        details: list[dict[str, Any]] = []
        unreachable: list[str] = []
        for host in missing:
            error = self.cache.error(host.host)
            if error is not None:
                reason = error_message(error, host.address)
                details.append({"host": host.address, "cause": f"{host.address}: {reason}", "log_tail": []})
                unreachable.append(f"{host.address}: {getattr(error, 'hint', '') or 'check the host'}")
                self.move(host, "failed", reason)
                continue
            evidence = self.cache.of(host.host).get(EVIDENCE)
            cause = diagnose(self.inventory, host.host, evidence, self.nodes, len(missing))
            details.append({"host": host.address, "cause": cause, "log_tail": evidence.log_tail})
            self.move(host, "failed", cause)
        first = missing[0].host
        hint = (
            f"{unreachable[0]}; then re-run `raycluster up`"
            if len(unreachable) == len(missing)
            else f"see `docker logs {container_name(self.inventory, first)}` on {first.address} (tail below), fix the "
            "cause, re-run `raycluster up`"
        )
        return NodesMissing(
            f"{len(missing)} node(s) did not join within {self.timeout_s:.0f}s: "
            + "; ".join(str(d["cause"]) for d in details),
            hint,
            details,
            [r.address for r in self.runs.values() if r.alive],
        )
