"""`up`'s look at the GCS: the head's node list, asked in a thread while the nodes register.

One look waits for every node to be alive while the registrations are watched: from a worker's container,
started with the wait for the head (it asks once that worker registered, on a CPU Ray no longer needs there),
so it is already asking when the head registers; else from the head's container once the head registered. A
node that failed ends that look early (`Look.cancel`), and the nodes that did join are read once more from the
head (`read_nodes`). Nothing here calls back into `up`'s phases: a look gets what it asks with (`Gcs`).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from raycluster_cli.config.inventory import Inventory
from raycluster_cli.errors import OperationError
from raycluster_cli.host.containers import early_start
from raycluster_cli.host.node import cancel_probe, probe
from raycluster_cli.progress import Progress
from raycluster_cli.transport.pool import Connect
from raycluster_cli.verbs.up_hosts import HostRun

log = logging.getLogger(__name__)

PROBE_RETRIES = 2  # a node list the head could not give is asked again this often
_PROBE_PAUSE_S = 2.0


@dataclass(frozen=True)
class Gcs:
    """What a look asks with: the cluster, its connections, the head's record, the node IDs of replaced workers
    that the head's GCS may still list as alive, and where to report."""

    inventory: Inventory
    connect: Connect
    head: HostRun
    stale: list[str]
    progress: Progress


def early_look(gcs: Gcs, workers: list[HostRun], expected: list[str], deadline: float) -> Look | None:
    """The look from a worker's container, started now, before the head registered: one remote command waits
    there until that worker's node registered, then asks the GCS from its container, where Ray's CPU is idle
    by then, until every node is alive. Only for a worker that starts its Ray while the head starts (its wait
    answers Ray's lookup of the head: containers.early_start); others register after the head, and the head's
    own container is asked once the head registered instead."""
    for worker in workers:
        if early_start(gcs.inventory, worker.host):
            return Look(gcs, expected, deadline, worker)
    return None


class Look:
    """The GCS's node list, asked in a thread while the nodes register, from `on`'s container (the probe's
    Python and Ray import, 1.5–2.5 s, then overlap their start instead of following it); `cancel` ends it
    early. A worker's look is asked once; if it fails, `result` asks the head's container instead."""

    def __init__(self, gcs: Gcs, expected: list[str], deadline: float, on: HostRun) -> None:
        self.gcs = gcs
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
        gcs = self.gcs
        try:
            if self.on is gcs.head:
                self.nodes = read_nodes(gcs, self.expected, self.deadline, self)
            else:
                window = max(0.0, self.deadline - time.monotonic())
                self.nodes = probe(
                    gcs.connect(self.on.host),
                    gcs.inventory,
                    self.expected,
                    window,
                    gcs.stale,
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
                cancel_probe(self.gcs.connect(self.on.host), self.gcs.inventory, self.key, self.on.host)

    def result(self) -> list[dict[str, Any]]:
        self.thread.join()
        if self.error is not None and self.on is not self.gcs.head and isinstance(self.error, Exception):
            log.debug("the look from %s failed (%s); asking the head", self.on.address, self.error)
            return read_nodes(self.gcs, self.expected, self.deadline)
        if self.error is not None:
            raise self.error
        return self.nodes


def read_nodes(gcs: Gcs, expected: list[str], deadline: float, look: Look | None = None) -> list[dict[str, Any]]:
    """The head's node list once `expected` are alive (or the deadline). A driver that a loaded head's raylet
    drops while registering ("Failed to register worker to Raylet") is transient: asked again a few times.
    For a `look`, the probe can be ended early (its `cancel`) and is not asked again once it was."""
    failures = 0
    while True:
        window = max(0.0, deadline - time.monotonic())
        try:
            return probe(
                gcs.connect(gcs.head.host),
                gcs.inventory,
                expected,
                window,
                gcs.stale,
                cancellable=look.key if look else "",
            )
        except OperationError as exc:
            failures += 1
            if failures > PROBE_RETRIES or time.monotonic() >= deadline or (look and look.cancelled.is_set()):
                raise
            gcs.progress(f"{exc.message}; asking the head again")
            time.sleep(_PROBE_PAUSE_S)
