"""One relay run, whatever travels (the node image for `up`, a model for `serve` and `bench`): learn each
receiving host's tools in one command, refuse by name a host that could not verify what it receives, let the
job be made for the hosts found (the image's codec depends on them), spread it (delivery/schedule.py), and
remove the hosts' staged copies after — also after Ctrl-C (each removal exempt from the cancellation, and
the hosts' own EXIT traps remove partial files when their session ends: delivery/receive.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from raycluster_cli import cancel
from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.delivery.receive import HASH_TOOLS, cleanup_command
from raycluster_cli.delivery.schedule import Delivery, Job, Receiver, Spread
from raycluster_cli.errors import OperationError
from raycluster_cli.host.folders import archive_dir as archive_dir_on_host
from raycluster_cli.progress import Progress
from raycluster_cli.transport import Transport
from raycluster_cli.transport.fanout import Outcome, fanout
from raycluster_cli.transport.pool import Connect

TOOLS_COMMAND = (
    "for t in zstd pigz bash timeout python3 sha256sum openssl; do command -v $t >/dev/null 2>&1 && echo $t; done; true"
)
CLEANUP_S = 20.0  # each host's removal of its staged copy, also after Ctrl-C


def relay(
    inventory: Inventory,
    connect: Connect,
    plan: list[Delivery],
    make_job: Callable[[list[frozenset[str]]], Job],
    progress: Progress,
) -> list[tuple[Delivery, Outcome[Delivery]]]:
    """Every planned host ends with its delivery or the error that stopped it (in the plan's order)."""
    host_of = {str(h.address): h for h in inventory.hosts}

    def tools_of(delivery: Delivery) -> tuple[Transport, frozenset[str]]:
        transport = connect(host_of[delivery.host])
        tools = frozenset(transport.run(TOOLS_COMMAND, timeout=30).stdout.split())
        if not tools & set(HASH_TOOLS):
            raise OperationError(
                f"{delivery.host}: has no sha256sum, python3 or openssl, so it could not verify what it receives: "
                "nothing is sent there",
                f"install coreutils (sha256sum) or python3 on {delivery.host}",
            )
        return transport, tools

    found = fanout(plan, tools_of, what="look for zstd, bash, python3 and sha256sum")
    reached = [(t, o.value) for t, o in found if o.value is not None]
    if not reached:
        return [(t, Outcome(error=o.error)) for t, o in found]
    job = make_job([tools for _, (_, tools) in reached])
    receivers = {
        t.host: _receiver(inventory, host_of[t.host], t, transport, tools, job) for t, (transport, tools) in reached
    }
    try:
        Spread(list(receivers.values()), job, progress).run()
    finally:
        clean_up(receivers.values(), job)
    outcomes: list[tuple[Delivery, Outcome[Delivery]]] = []
    for delivery, outcome in found:
        receiver = receivers.get(delivery.host)
        if receiver is not None and receiver.result is not None:
            outcomes.append((delivery, receiver.result))
        else:
            outcomes.append((delivery, Outcome(error=outcome.error or OperationError(f"{delivery.host}: not sent"))))
    return outcomes


def _receiver(
    inventory: Inventory, host: HostConfig, delivery: Delivery, transport: Transport, tools: frozenset[str], job: Job
) -> Receiver:
    return Receiver(
        delivery,
        inventory.node_ip(host),
        transport,
        {"bash", "timeout"} <= tools,
        archive_dir=archive_dir_on_host(inventory, host),
        listens="python3" in tools or job.image_on_hosts,
        tools=tools,
    )


def clean_up(receivers: Iterable[Receiver], job: Job) -> None:
    """Remove each host's staged copy, in parallel, each thread exempt from the cancellation (an interrupted run
    still cleans up); a host that does not answer within CLEANUP_S keeps its copy (`down --purge` removes it)."""

    def one(receiver: Receiver) -> None:
        with cancel.exempt():
            try:
                receiver.transport.run(cleanup_command(job.remote(receiver.archive_dir)), timeout=CLEANUP_S)
            except BaseException:  # best effort: the run's own outcome is what the caller reports
                return

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in receivers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CLEANUP_S + 5)
