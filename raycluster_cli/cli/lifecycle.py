"""The cluster's life: doctor, up, down, status (and version)."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer

from raycluster_cli import __version__
from raycluster_cli.config.inventory import Inventory
from raycluster_cli.config.state import cluster_lock, state_dir
from raycluster_cli.errors import ExitCode, UsageError
from raycluster_cli.render.base import Output
from raycluster_cli.render.checks import render_checks
from raycluster_cli.render.lifecycle import render_down, render_status, render_up

if TYPE_CHECKING:
    from raycluster_cli.checks.network import Tool
    from raycluster_cli.verbs.status import StatusResult

from raycluster_cli.cli.common import (
    DebugOpt,
    IgnoreOpt,
    InventoryOpt,
    JsonOpt,
    emit,
    execute,
    open_cluster,
    repeat_until_interrupt,
)


def doctor(
    inventory_path: InventoryOpt = None,
    ignore: IgnoreOpt = None,
    network: Annotated[
        bool, typer.Option("--network", help="also measure latency, bandwidth both ways and MTU head ↔ each worker")
    ] = False,
    network_tool: Annotated[
        str, typer.Option(help="bandwidth tool: auto (iperf3 when both hosts have it), iperf3 or builtin")
    ] = "auto",
    json_mode: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Preflight every host over SSH; each finding names the host and the fix. Exit 1 on any failure."""

    def action(output: Output) -> int:
        from raycluster_cli.checks import Status, demote, ignore_ids, run_checks

        ignored = ignore_ids(ignore)
        if network_tool not in ("auto", "iperf3", "builtin"):
            raise UsageError(f"--network-tool {network_tool!r} is unknown", "use auto, iperf3 or builtin")
        with open_cluster(inventory_path) as (inv, pool):
            results = run_checks(inv, pool, ignore=ignored)
            if network:
                from raycluster_cli.checks.network import measure_network

                tool = cast("Tool", network_tool)
                results += demote(measure_network(inv, pool, output.progress(), tool), ignored)
        ok = not any(r.status == Status.FAIL for r in results)
        body = {"cluster": inv.cluster, "checks": [r.to_dict() for r in results]}
        return emit(output, ok, body, lambda out, _: render_checks(out, results))

    execute(json_mode, debug, action)


def up_command(
    inventory_path: InventoryOpt = None,
    ignore: IgnoreOpt = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the head and for every node")] = 180.0,
    insecure: Annotated[
        bool, typer.Option("--insecure", help="turn Ray token authentication off (trusted, isolated networks only)")
    ] = False,
    json_mode: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Start Ray in Docker: images where missing, the head, every worker in parallel meanwhile; wait for all.

    Exit 0: every node joined; 1: preflight failed, or a node did not join (each named with its cause)."""

    def action(output: Output) -> int:
        from raycluster_cli.checks import Status, ignore_ids
        from raycluster_cli.render.up import up_view
        from raycluster_cli.verbs.up import up

        ignored = ignore_ids(ignore)
        with (
            open_cluster(inventory_path) as (inv, pool),
            up_view(output) as progress,
            cluster_lock(inv, "up", progress=progress),
        ):
            if insecure or inv.ray.auth == "none":
                output.warning(f"Ray token authentication is OFF for cluster {inv.cluster} (--insecure / ray.auth)")
            result = up(inv, pool, ignore=ignored, timeout_s=timeout, insecure=insecure, progress=progress)
        auth = result.inventory.ray.auth == "token"
        token_file = str(state_dir(inv) / "auth-token") if auth else None
        body = {
            "cluster": inv.cluster,
            "head": result.head,
            "dashboard_url": result.dashboard_url,
            "auth": "token" if auth else "none",
            "auth_token_file": token_file,
            "seconds": round(result.seconds, 2),
            "nodes": [n.to_dict() for n in result.nodes],
            "images": [t.to_dict() for t in result.images],
            "warnings": result.warnings,
            "service_grown": result.service_grown,
            "checks": [r.to_dict() for r in result.checks if r.status != Status.OK],
            "next": _next_steps(result.head, inv.ray.port, result.dashboard_url, token_file, inventory_path),
        }
        return emit(output, result.ok, body, render_up)

    execute(json_mode, debug, action)


def _next_steps(
    head: str, port: int, dashboard: str, token_file: str | None, inventory_path: str | None
) -> dict[str, str]:
    """Where to go after `up`: addresses and commands (the token by its file, never its value), each path and
    address quoted for the shell (an inventory path with a space or a `;` stays one argument)."""
    auth = f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={shlex.quote(token_file)} " if token_file else ""
    inv = f" -i {shlex.quote(inventory_path)}" if inventory_path else ""
    return {
        "ray_address": f"{head}:{port}",
        "dashboard_url": dashboard,
        "submit_job": f"{auth}ray job submit --address {shlex.quote(dashboard)} --working-dir . -- python script.py",
        "status": f"raycluster status{inv}",
        "logs": f"raycluster logs{inv}",
    }


def down_command(
    inventory_path: InventoryOpt = None,
    purge: Annotated[
        bool,
        typer.Option("--purge", help="also remove the image from the hosts and the token and files `up` made"),
    ] = False,
    host: Annotated[
        str | None,
        typer.Option("--host", help="only this worker: its node drained first when a service runs, the rest untouched"),
    ] = None,
    deadline: Annotated[
        float, typer.Option("--deadline", help="with --host: seconds its streams get to finish before they move")
    ] = 120.0,
    json_mode: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Remove the containers that `up` started (found by this cluster's labels), and nothing else.

    The image stays on the hosts unless --purge. With --host, only that worker's (never the head's).
    Exit 0: done (also when nothing was there); 1: a host failed."""

    def action(output: Output) -> int:
        from raycluster_cli.verbs.down import down, down_host

        if host is not None and purge:
            raise UsageError("--host and --purge exclude each other", "take the node out first, then purge the cluster")
        with (
            open_cluster(inventory_path) as (inv, pool),
            output.live_progress() as progress,
            cluster_lock(inv, "down", progress=progress),
        ):
            if host is not None:
                result = down_host(inv, pool, host, deadline_s=deadline, progress=progress)
            else:
                result = down(inv, pool, purge=purge, progress=progress)
        body: dict[str, Any] = {
            "cluster": inv.cluster,
            "removed": result.removed,
            "purged": result.purged,
            "errors": result.errors,
        }
        if host is not None:
            body["drained"] = result.drained
        return emit(output, result.ok, body, render_down)

    execute(json_mode, debug, action)


def status_command(
    inventory_path: InventoryOpt = None,
    watch: Annotated[bool, typer.Option("--watch", help="redraw the table in place until Ctrl-C")] = False,
    interval: Annotated[float, typer.Option(min=0.5, help="seconds between refreshes with --watch")] = 2.0,
    json_mode: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Per host: container state, Ray node alive, resources, image ID, Ray version; cluster totals.

    Exit 0: every host's container runs and its Ray node is alive; 1: degraded or down. With --watch:
    0 after Ctrl-C (the normal end)."""

    def action(output: Output) -> int:
        from raycluster_cli.verbs.status import status

        if watch and json_mode:
            raise UsageError("--watch redraws a table; --json prints one document", "use one of them")
        with open_cluster(inventory_path) as (inv, pool):
            if watch:
                from raycluster_cli.render.operate import live_status

                with live_status(output) as show:
                    repeat_until_interrupt(lambda: show(_status_body(inv, status(inv, pool))), interval)
                return ExitCode.OK
            result = status(inv, pool)
        return emit(output, result.state == "healthy", _status_body(inv, result), render_status)

    execute(json_mode, debug, action)


def _status_body(inv: Inventory, result: StatusResult) -> dict[str, Any]:
    return {
        "cluster": inv.cluster,
        "state": result.state,
        "hosts": [h.to_dict() for h in result.hosts],
        "totals": result.totals(),
        "service": result.service,
        "service_error": result.service_error,
    }


def version() -> None:
    """Print raycluster's version."""
    print(__version__)
