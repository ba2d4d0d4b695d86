"""Operating a running cluster: logs, exec, submit, dashboard, metrics."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from raycluster_cli.cli.common import DebugOpt, InventoryOpt, JsonOpt, emit, execute, open_cluster, wait_for_interrupt
from raycluster_cli.config.defaults import (
    DEFAULT_MAX_MIB,
    DEFAULT_TIMEOUT_S,
)
from raycluster_cli.config.inventory import Inventory
from raycluster_cli.config.state import token_file
from raycluster_cli.errors import ExitCode, UsageError
from raycluster_cli.render.base import (
    Output,
    render_logs,
)


def metrics_command(
    inventory_path: InventoryOpt = None,
    out: Annotated[Path, typer.Option("--out", help="folder for prometheus/ and grafana/dashboards/")] = Path(
        "raycluster-metrics"
    ),
    json_mode: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Write a Prometheus file_sd target file for every node's metrics and Ray's Grafana dashboards.

    Exit 0: every target answered a scrape; 1: some did not (the files are written all the same)."""

    def action(output: Output) -> int:
        from raycluster_cli.render.operate import render_metrics
        from raycluster_cli.verbs.metrics import collect_metrics

        with open_cluster(inventory_path) as (inv, pool):
            result = collect_metrics(inv, pool, out)
        body = {
            "cluster": inv.cluster,
            "out": str(out),
            "targets": [t.to_dict() | {"role": _role(inv, t.host)} for t in result.targets],
            "files": result.files,
            "dashboards_dir": str(out / "grafana" / "dashboards"),
            "dashboards": result.dashboards,
            "warnings": result.warnings,
        }
        return emit(output, result.ok, body, render_metrics)

    execute(json_mode, debug, action)


def _role(inv: Inventory, address: str) -> str:
    return next((h.role for h in inv.hosts if str(h.address) == address), "dashboard")


def logs_command(
    inventory_path: InventoryOpt = None,
    host: Annotated[list[str] | None, typer.Option("--host", help="only this host's address (repeatable)")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="folder to write DIR/<host>/ into")] = None,
    max_mib: Annotated[
        float,
        typer.Option(
            "--max-mib", min=0.001, help="at most this many MiB per host: the container log's tail, then Ray's logs"
        ),
    ] = DEFAULT_MAX_MIB,
    timeout: Annotated[
        float, typer.Option("--timeout", min=1, help="seconds each host's log stream may take")
    ] = DEFAULT_TIMEOUT_S,
    json_mode: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Collect each node's container log and Ray session logs into DIR/<host>/, with a count of error lines.

    Streamed to disk, at most --max-mib per host (the newest part of the container log is kept; what was
    cut is reported). Exit 0: every host's logs were collected; 1: some host's could not be."""

    def action(output: Output) -> int:
        from raycluster_cli.verbs.logs import MIB, Limits, collect

        with open_cluster(inventory_path) as (inv, pool):
            chosen = [h for h in inv.hosts if not host or str(h.address) in host]
            unknown = sorted(set(host or []) - {str(h.address) for h in inv.hosts})
            if unknown:
                raise UsageError(
                    f"--host {', '.join(unknown)} is not in the inventory",
                    "use one of: " + ", ".join(str(h.address) for h in inv.hosts),
                )
            folder = out or Path(f"raycluster-logs-{inv.cluster}-{time.strftime('%Y%m%d-%H%M%S')}")
            output.progress()(f"collecting logs of {len(chosen)} host(s) into {folder}")
            results = collect(inv, pool, folder, chosen, Limits(int(max_mib * MIB), timeout))
        ok = all(not r.error for r in results)
        body = {"cluster": inv.cluster, "out": str(folder), "hosts": [r.to_dict() for r in results]}
        return emit(output, ok, body, render_logs)

    execute(json_mode, debug, action)


def exec_command(
    words: Annotated[list[str], typer.Argument(help="the command, after --; its words are joined and run by sh")],
    inventory_path: InventoryOpt = None,
    host: Annotated[list[str] | None, typer.Option("--host", help="run on this host's address (repeatable)")] = None,
    every: Annotated[bool, typer.Option("--all", help="run on every host of the inventory")] = False,
    timeout: Annotated[float | None, typer.Option(help="seconds the command may run (default: no limit)")] = None,
    json_mode: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Run a command in this cluster's Ray container (the head, or --host …/--all in parallel), env sourced.

    Exit: the command's exit status (the highest of several); 255 where it could not run (host unreachable,
    no running container), as ssh does; 2 bad flags or inventory; 130 interrupted."""

    def action(output: Output) -> int:
        from raycluster_cli.render.operate import ExecPrinter, render_exec
        from raycluster_cli.verbs.execute import choose_hosts, run_exec, worst

        with open_cluster(inventory_path) as (inv, pool):
            chosen = choose_hosts(inv, host, every)
            printer = ExecPrinter(output, prefixed=len(chosen) > 1)
            results = run_exec(inv, pool, chosen, words, on_output=printer, timeout_s=timeout)
        code = worst(results)
        body = {"cluster": inv.cluster, "rc": code, "hosts": [r.to_dict() for r in results]}
        emit(output, code == 0, body, render_exec)
        return code

    execute(json_mode, debug, action)


def submit_command(
    entrypoint: Annotated[list[str], typer.Argument(help="the job's command after --, e.g. python script.py")],
    inventory_path: InventoryOpt = None,
    working_dir: Annotated[
        Path | None, typer.Option("--working-dir", help="folder uploaded for the job (its working directory)")
    ] = None,
    no_wait: Annotated[bool, typer.Option("--no-wait", help="return once the job is accepted")] = False,
    submission_id: Annotated[str | None, typer.Option(help="the job's submission ID (default: made up)")] = None,
    json_mode: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Run a Ray job on the cluster with its token, through the head's SSH connection; stream its logs.

    Exit: 0 job succeeded (or accepted, with --no-wait); the driver's exit code when it failed (1 when Ray
    knows none, or it was stopped); 1 submission failed; 2 bad flags or inventory; 130 interrupted (the
    job keeps running: the output says how to stop it)."""

    def action(output: Output) -> int:
        from raycluster_cli.render.operate import JobLogPrinter, render_interrupted_job, render_submit
        from raycluster_cli.verbs.jobs import (
            Dashboard,
            check_dashboard,
            dashboard_tunnel,
            follow_job,
            stop_hint,
            submit_job,
        )

        with open_cluster(inventory_path) as (inv, pool), dashboard_tunnel(inv, pool) as (tunnel, token):
            dashboard = Dashboard(tunnel, token, host=str(inv.head_host.address))
            version = check_dashboard(dashboard)
            job = submit_job(dashboard, entrypoint, working_dir=working_dir, submission_id=submission_id)
            output.progress()(
                f"job {job.submission_id} submitted to cluster {inv.cluster} (Ray {version.get('ray_version', '?')})"
            )
            job.waited = not no_wait
            if job.waited:
                try:
                    follow_job(dashboard, job, JobLogPrinter(output))
                except KeyboardInterrupt:
                    return render_interrupted_job(output, inv.cluster, job, stop_hint(inv, job.submission_id))
        body = {"cluster": inv.cluster, "job": job.to_dict(), "exit_code": job.code}
        emit(output, job.code == 0, body, render_submit)
        return job.code

    execute(json_mode, debug, action)


def dashboard_command(
    inventory_path: InventoryOpt = None,
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="local port (0: any free one)")] = 8265,
    json_mode: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Forward 127.0.0.1:PORT to the head's dashboard over SSH; print the URL; stay until Ctrl-C.

    Exit: 0 after Ctrl-C (the normal end); 1 the dashboard does not answer; 2 bad flags, inventory or a
    local port in use."""

    def action(output: Output) -> int:
        from raycluster_cli.render.operate import render_dashboard
        from raycluster_cli.verbs.jobs import Dashboard, check_dashboard, dashboard_tunnel

        with open_cluster(inventory_path) as (inv, pool), dashboard_tunnel(inv, pool, port) as (tunnel, token):
            version = check_dashboard(Dashboard(tunnel, token, host=str(inv.head_host.address)))
            body = {
                "cluster": inv.cluster,
                "url": tunnel.url,
                "head_dashboard": f"{inv.head_address}:{inv.ray.dashboard_port}",
                "ray_version": version.get("ray_version", ""),
                "auth_token_file": str(token_file(inv)) if inv.ray.auth == "token" else None,
            }
            emit(output, True, body, render_dashboard)
            wait_for_interrupt()
        return ExitCode.OK

    execute(json_mode, debug, action)
