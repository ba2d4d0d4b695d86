"""A running fleet's nodes, one at a time: drain and undrain (`down --host` and `up` are lifecycle's)."""

from __future__ import annotations

from typing import Annotated

import typer

from raycluster_cli.cli.common import DebugOpt, InventoryOpt, JsonOpt, emit, execute, open_cluster
from raycluster_cli.config.state import cluster_lock
from raycluster_cli.render.base import Output

HostArg = Annotated[str, typer.Argument(help="the host's address, as the inventory names it")]


def drain_command(
    host: HostArg,
    inventory_path: InventoryOpt = None,
    deadline: Annotated[
        float, typer.Option("--deadline", help="seconds its streams get to finish; those left then move on")
    ] = 120.0,
    undo: Annotated[bool, typer.Option("--undo", help="let the host back (as raycluster undrain HOST)")] = False,
    json_mode: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Take a host's node out of the running service: pipelines without it are built first, then no new request
    goes to it, its streams finish within --deadline (those left continue elsewhere from what they sent).

    The node stays in Ray and out of the service until `raycluster undrain HOST`. Exit 0: drained; 1: refused
    (nothing else could serve) or the service could not be reached; 2: bad input."""
    if undo:
        undrain_command(host, inventory_path, json_mode, debug)
        return

    def action(output: Output) -> int:
        from raycluster_cli.render.lifecycle import render_drain
        from raycluster_cli.verbs.drain import check_deadline, drain, find_host

        check_deadline(deadline)
        with (
            open_cluster(inventory_path) as (inv, pool),
            output.live_progress() as progress,
            cluster_lock(inv, "drain", progress=progress),
        ):
            find_host(inv, host)  # bad input before any progress line
            progress(f"draining {host} (its streams get {deadline:g} s to finish)")
            result = drain(inv, pool, host, deadline)
        return emit(output, True, {"cluster": inv.cluster, **result.to_dict()}, render_drain)

    execute(json_mode, debug, action)


def undrain_command(
    host: HostArg, inventory_path: InventoryOpt = None, json_mode: JsonOpt = False, debug: DebugOpt = False
) -> None:
    """Let a drained host's node back into the running service, taken in at once (not at its periodic look).

    Exit 0: done (also when it was not drained); 1: the service could not be reached; 2: bad input."""

    def action(output: Output) -> int:
        from raycluster_cli.render.lifecycle import render_drain
        from raycluster_cli.verbs.drain import find_host, undrain

        with (
            open_cluster(inventory_path) as (inv, pool),
            output.live_progress() as progress,
            cluster_lock(inv, "undrain", progress=progress),
        ):
            find_host(inv, host)
            progress(f"letting {host} back into the service")
            result = undrain(inv, pool, host)
        return emit(output, True, {"cluster": inv.cluster, **result.to_dict()}, render_drain)

    execute(json_mode, debug, action)
