"""The last phases of `up` over the hosts' records (uprun.py): start the head, start the workers, wait.

Each node's own container log says when Ray registered it (`ray start` prints "Ray runtime started." only once
the GCS knows the node): `up` watches that on each host with one remote command that runs nothing but docker's
CLI, so no Python start-up competes with a starting node. The head's container starts first and every
worker's right after it, without waiting: a worker's container waits until the head's GCS answers before its
`ray start` (containers.start_script), and then, unless the inventory gives the head and the worker different
temp folders, starts its Ray without waiting for the head's node to register (Ray's own `ray start` would: the
head registers last, after its dashboard, raylet and agents). So the workers' containers, their imports and
their whole Ray start overlap the head's start, where the hand-written way (head until its GCS answers, then
the workers) does them in turn and its workers' raylets wait for the head's node. One look at the GCS waits, in
a thread, for every node to be alive while the registrations are watched: from such a worker's container,
started with the wait for the head (it asks once that worker registered, on a CPU Ray no longer needs there),
so it is already asking when the head registers; else from the head's container once the head registered. A
node that failed ends that look early, and the nodes that did join are read once more (from the head).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from typing import Any

from .containers import container_name, early_start
from .diagnose import EVIDENCE, diagnose
from .errors import OperationError
from .nodes import EXITED, Plan, apply, cancel_probe, probe, start_failure, wait_started
from .transport.fanout import error_message, fanout
from .uprun import HostRun, UpRun

log = logging.getLogger(__name__)


class NodesMissing(OperationError):
    """Some nodes did not join: one diagnosis (and log tail) per missing host in `details`."""

    def __init__(self, message: str, hint: str, details: list[dict[str, Any]], joined: list[str] | None = None) -> None:
        super().__init__(message, hint)
        self.details = details
        self.joined = joined or []  # the hosts whose nodes did join


def start_head(run: UpRun) -> None:
    """Start (or keep) the head's container; `wait` waits for its node (the workers start meanwhile)."""
    head = run.head
    replaced = {r.node_ip for r in run.workers if r.plan.action != "keep"}
    if head.plan.action == "keep" and replaced:
        # The head stays: nodes of workers about to be replaced may linger in its GCS: note their IDs.
        before = probe(run.connect(head.host), run.inventory, [], 0)
        run.stale = [n["node_id"] for n in before if n["alive"] and n["node_ip"] in replaced]
    for each in run.runs.values():
        if each.reason:
            run.progress(f"{each.address}: replacing the {each.role} container: {each.reason}")
    _start(run, head)
    if run.workers:
        run.progress(f"head starting; {len(run.workers)} worker(s) start now and join once its GCS answers")


def _start(run: UpRun, host: HostRun) -> None:
    """Write the host's files and start (or keep) its container: one remote command."""
    keep = host.plan.action == "keep"
    run.move(host, "starting", host.reason or ("its container runs as asked" if keep else ""))
    try:
        host.action = apply(run.connect(host.host), run.inventory, host.host, host.plan, run.files(host))
    except Exception as exc:
        run.fail([host], exc)
        raise
    run.move(host, "waiting", "for its Ray node to register")


def _until_registered(run: UpRun, host: HostRun, deadline: float) -> OperationError | None:
    """Wait until the host's node is registered; a container that exits while starting is started once more
    (Ray gives a starting node a fixed 30 s to register, which a loaded host can miss), and so is one that `up`
    found running and kept but that exited before its wait (a head that outlived a long freeze can exit a few
    seconds after it; its workers then join the new head: `wait`). The error if not."""
    while True:
        timeout_s = max(0.0, deadline - time.monotonic())
        result = wait_started(run.connect(host.host), run.inventory, host.host, timeout_s)
        if result.ok:
            run.move(host, "waiting", "registered; the head's GCS is asked")
            return None
        if result.rc != EXITED or host.retried or time.monotonic() >= deadline:
            error = start_failure(run.inventory, host.host, result, run.timeout_s)
            run.move(host, "failed", error_message(error, host.address))
            return error
        when = (
            ", found running, exited before up waited for it"
            if host.plan.action == "keep"
            else " exited while starting"
        )
        run.progress(f"{host.address}: the {host.role} container{when}; starting it once more")
        host.restarted()
        _start(run, host)


def start_workers(run: UpRun) -> None:
    """Write each worker's files and start (or keep) its container, all at once: one remote command each."""
    fanout(run.workers, lambda w: _start(run, w), what="start the workers").raise_failures()


def wait(run: UpRun) -> None:
    """Until the head's node is registered, then every worker registered (each seen on its host) and every
    node alive in the head's GCS (asked meanwhile).

    Raises the head's start failure, or NodesMissing naming each node that did not join, with why (its
    container's state and log).
    """
    run.progress("waiting for every node to join")
    deadline = time.monotonic() + run.timeout_s
    expected = sorted(r.node_ip for r in run.runs.values())
    early = _early_look(run, expected, deadline)
    error = _until_registered(run, run.head, deadline)
    if error is not None:
        if early is not None:
            early.cancel()
        for worker in run.workers:
            run.move(worker, "failed", f"the head at {run.head.address} did not start")
        raise error
    if run.head.retried and run.workers:  # the workers that met the first head's GCS join the second one
        if early is not None:  # its container is replaced: the head is asked instead
            early.cancel()
            early = None
        for worker in run.workers:
            worker.plan = Plan("replace", "the head was started once more")
            worker.reason = "; ".join(filter(None, [worker.reason, worker.plan.reason]))
        start_workers(run)
    look = early or _Look(run, expected, deadline, run.head)
    waited = fanout(run.workers, lambda w: _until_registered(run, w, deadline), what="wait for the workers")
    waited.check_interrupted()  # the look ends by its own deadline: no remote command runs after an interrupt
    for worker, failure in waited.failed:
        run.move(worker, "failed", error_message(failure, worker.address))
    registered = [r for r in run.runs.values() if r.phase != "failed"]
    if len(registered) == len(run.runs):
        run.nodes = look.result()
    else:
        look.cancel()
        run.nodes = _read_nodes(run, sorted(r.node_ip for r in registered), deadline)
    alive = {n["node_ip"]: n for n in run.nodes if n["alive"] and n["node_id"] not in run.stale}
    for host in registered:
        if host.node_ip in alive:
            host.resources = alive[host.node_ip].get("resources", {})
            run.move(host, "joined", host.action)
    missing = [r for r in run.runs.values() if not r.alive]
    if missing:
        raise _missing_error(run, missing)


def _early_look(run: UpRun, expected: list[str], deadline: float) -> _Look | None:
    """The look from a worker's container, started now, before the head registered: one remote command waits
    there until that worker's node registered, then asks the GCS from its container, where Ray's CPU is idle
    by then, until every node is alive. Only for a worker that starts its Ray while the head starts (its wait
    answers Ray's lookup of the head: containers.early_start); others register after the head, and the head's
    own container is asked once the head registered instead."""
    for worker in run.workers:
        if early_start(run.inventory, worker.host):
            return _Look(run, expected, deadline, worker)
    return None


class _Look:
    """The GCS's node list, asked in a thread while the nodes register, from `on`'s container (the probe's
    Python and Ray import, 1.5–2.5 s, then overlap their start instead of following it); `cancel` ends it
    early. A worker's look is asked once; if it fails, `result` asks the head's container instead."""

    def __init__(self, run: UpRun, expected: list[str], deadline: float, on: HostRun) -> None:
        self.run = run
        self.on = on
        self.expected = expected
        self.deadline = deadline
        self.cancelled = threading.Event()
        self.key = secrets.token_hex(6)  # names this look's probe, which cancel ends
        self.nodes: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._ask, daemon=True, name="up-look")
        self.thread.start()

    def _ask(self) -> None:
        try:
            if self.on is self.run.head:
                self.nodes = _read_nodes(self.run, self.expected, self.deadline, self)
            else:
                window = max(0.0, self.deadline - time.monotonic())
                self.nodes = probe(
                    self.run.connect(self.on.host),
                    self.run.inventory,
                    self.expected,
                    window,
                    self.run.stale,
                    cancellable=self.key,
                    host=self.on.host,
                )
        except BaseException as exc:  # handed to the caller by result()
            self.error = exc

    def cancel(self) -> None:
        """End the look (a worker failed: the nodes that joined are read once more instead). A look whose
        worker failed is left to its own deadline: that host may not answer."""
        self.cancelled.set()
        if self.thread.is_alive() and self.on.phase != "failed":
            with contextlib.suppress(Exception):  # else the look ends by its own deadline
                cancel_probe(self.run.connect(self.on.host), self.run.inventory, self.key, self.on.host)

    def result(self) -> list[dict[str, Any]]:
        self.thread.join()
        if self.error is not None and self.on is not self.run.head and isinstance(self.error, Exception):
            log.debug("the look from %s failed (%s); asking the head", self.on.address, self.error)
            return _read_nodes(self.run, self.expected, self.deadline)
        if self.error is not None:
            raise self.error
        return self.nodes


PROBE_RETRIES = 2  # a node list the head could not give is asked again this often
_PROBE_PAUSE_S = 2.0


def _read_nodes(run: UpRun, expected: list[str], deadline: float, look: _Look | None = None) -> list[dict[str, Any]]:
    """The head's node list once `expected` are alive (or the deadline). A driver that a loaded head's raylet
    drops while registering ("Failed to register worker to Raylet") is transient: asked again a few times.
    For a `look`, the probe can be ended early (its `cancel`) and is not asked again once it was."""
    failures = 0
    while True:
        window = max(0.0, deadline - time.monotonic())
        try:
            return probe(
                run.connect(run.head.host),
                run.inventory,
                expected,
                window,
                run.stale,
                cancellable=look.key if look else "",
            )
        except OperationError as exc:
            failures += 1
            if failures > PROBE_RETRIES or time.monotonic() >= deadline or (look and look.cancelled.is_set()):
                raise
            run.progress(f"{exc.message}; asking the head again")
            time.sleep(_PROBE_PAUSE_S)


def _missing_error(run: UpRun, missing: list[HostRun]) -> NodesMissing:
    """Name each host whose node did not join, with its log tail and the likely cause; the hint is the fix of
    the hosts that could not even be asked (frozen, cut off) when every missing host is such a one."""
    run.cache.gather([r.host for r in missing], lambda ctx: [EVIDENCE], refresh=[EVIDENCE])
    details: list[dict[str, Any]] = []
    unreachable: list[str] = []
    for host in missing:
        error = run.cache.error(host.host)
        if error is not None:
            reason = error_message(error, host.address)
            details.append({"host": host.address, "cause": f"{host.address}: {reason}", "log_tail": []})
            unreachable.append(f"{host.address}: {getattr(error, 'hint', '') or 'check the host'}")
            run.move(host, "failed", reason)
            continue
        evidence = run.cache.of(host.host).get(EVIDENCE)
        cause = diagnose(run.inventory, host.host, evidence, run.nodes, len(missing))
        details.append({"host": host.address, "cause": cause, "log_tail": evidence.log_tail})
        run.move(host, "failed", cause)
    first = missing[0].host
    hint = (
        f"{unreachable[0]}; then re-run `raycluster up`"
        if len(unreachable) == len(missing)
        else f"see `docker logs {container_name(run.inventory, first)}` on {first.address} (tail below), fix the "
        "cause, re-run `raycluster up`"
    )
    return NodesMissing(
        f"{len(missing)} node(s) did not join within {run.timeout_s:.0f}s: "
        + "; ".join(str(d["cause"]) for d in details),
        hint,
        details,
        [r.address for r in run.runs.values() if r.alive],
    )
