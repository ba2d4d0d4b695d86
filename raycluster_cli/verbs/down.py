"""`down`: remove this cluster's containers (and with --purge the image and files `up` put on the hosts); with
`--host`, one worker's only, its node drained first.

Never prints: progress goes through the callback the caller gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.config.state import purge_local
from raycluster_cli.delivery.receive import purge_command
from raycluster_cli.errors import OperationError, RayclusterError, UsageError
from raycluster_cli.host.containers import host_state_dir, list_cluster_containers
from raycluster_cli.host.folders import archive_dir, fix_hint, refusal, remove_dir_command
from raycluster_cli.progress import Progress, quiet
from raycluster_cli.transport import quote
from raycluster_cli.transport.fanout import error_message, fanout
from raycluster_cli.transport.pool import Connect


@dataclass
class DownResult:
    removed: list[dict[str, str]]
    errors: list[dict[str, str]]
    purged: list[dict[str, str]] = field(default_factory=list)
    drained: dict[str, Any] | None = None  # `down --host`: what draining its node did (verbs/drain.py)

    @property
    def ok(self) -> bool:
        return not self.errors


def down(inventory: Inventory, connect: Connect, *, purge: bool = False, progress: Progress = quiet) -> DownResult:
    """Remove this cluster's labelled containers: workers in parallel first, then the head.

    With `purge`, also the image on every host, the files `up` put there (the host state folder) and
    the token and image archive in this machine's state dir.
    """
    removed: list[dict[str, str]] = []
    errors: list[dict[str, str]] = []
    purged: list[dict[str, str]] = []

    def remove_on(host: HostConfig) -> list[str]:
        return _remove(inventory, connect, host)

    def record_error(host: HostConfig, error: BaseException) -> None:
        message = error.one_line() if isinstance(error, RayclusterError) else error_message(error)
        errors.append({"host": str(host.address), "error": message})

    for what, group in (("worker", inventory.workers), ("head", [inventory.head_host])):
        if group:
            progress(f"removing this cluster's {what} container(s) on {len(group)} host(s)")
        removing = fanout(group, remove_on, what=f"remove the {what} containers")
        removing.check_interrupted()
        for host, outcome in removing:
            if outcome.error is not None:
                record_error(host, outcome.error)
            for name in outcome.value or []:
                removed.append({"host": str(host.address), "container": name})
    if purge:
        failed = {e["host"] for e in errors}
        progress(f"purging the image and raycluster's files on {len(inventory.hosts) - len(failed)} host(s)")
        purging = fanout(
            [h for h in inventory.hosts if str(h.address) not in failed], _purge_host(inventory, connect), what="purge"
        )
        purging.check_interrupted()
        for host, outcome in purging:
            if outcome.error is not None:
                record_error(host, outcome.error)
            for item in outcome.value or []:
                purged.append({"host": str(host.address), "item": item})
        # Keep this machine's token while some host still has its copy: a re-run after fixing that host
        # finishes the purge. The lock file stays (the running `down` holds it).
        local = purge_local(inventory) if not errors else None
        if local is not None:
            purged.append({"host": "localhost", "item": str(local)})
    return DownResult(removed, errors, purged)


def _remove(inventory: Inventory, connect: Connect, host: HostConfig) -> list[str]:
    """Remove this cluster's containers on one host; their names."""
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


def down_host(
    inventory: Inventory, connect: Connect, address: str, *, deadline_s: float, progress: Progress = quiet
) -> DownResult:
    """One worker's node out, the others untouched: drained first when a service runs (its streams finish or move,
    its pipelines re-split over the others), then its container removed.  The head is refused: it holds the GCS
    and the service's ingress, so taking it out is taking the whole cluster down."""
    from raycluster_cli.verbs.drain import NoService, check_deadline, drain, find_host

    check_deadline(deadline_s)
    host = find_host(inventory, address)
    if host.role == "head":
        raise UsageError(
            f"{address} is the head: it holds the cluster (its GCS and the service's ingress)",
            "raycluster down takes the whole cluster down",
        )
    drained: dict[str, Any] | None = None
    progress(f"draining {address} (its streams get {deadline_s:g} s to finish)")
    try:
        drained = drain(inventory, connect, address, deadline_s).to_dict()
    except NoService:
        progress("no service is deployed: nothing to drain")
    progress(f"removing this cluster's container on {address}")
    result = DownResult([], [], drained=drained)
    try:
        result.removed = [{"host": address, "container": name} for name in _remove(inventory, connect, host)]
    except RayclusterError as exc:
        result.errors.append({"host": address, "error": exc.one_line()})
    return result


def _purge_host(inventory: Inventory, connect: Connect) -> Callable[[HostConfig], list[str]]:
    def purge(host: HostConfig) -> list[str]:
        transport = connect(host)
        done = []
        present = transport.run("docker image inspect --format '{{.Id}}' " + quote(inventory.image))
        if present.ok:
            result = transport.run("docker rmi " + quote(inventory.image), timeout=300)
            if not result.ok:
                raise OperationError(
                    f"{host.address}: cannot remove image {inventory.image}: {result.first_line()}",
                    f"a container still uses it: see `docker ps -a` on {host.address}",
                )
            done.append(f"image {inventory.image}")
        folder = host_state_dir(inventory, host)
        result = transport.run(remove_dir_command(inventory, host))
        refused = refusal(inventory, host, result.stderr, "down --purge leaves it")
        if refused is not None:
            raise refused
        if not result.ok:
            raise OperationError(
                f"{host.address}: cannot remove {folder}: {result.first_line()}", fix_hint(inventory, host)
            )
        if "removed" in result.stdout.split():
            done.append(folder)
        staging = archive_dir(inventory, host)  # the relay's staging folder: only when it is the login user's own
        if "removed" in transport.run(purge_command(staging), timeout=120).stdout.split():
            done.append(staging)
        return done

    return purge
