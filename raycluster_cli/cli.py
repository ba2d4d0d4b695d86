"""The thin command-line layer: parse → call one library function → render → exit code."""

from __future__ import annotations

import inspect
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer

from . import __version__, interrupt, inventory, prelogin
from .bench.options import BenchOptions, ValidationError, flag_of
from .errors import ExitCode, GroupError, RayclusterError, UsageError
from .flagdefaults import DEFAULT_MAX_MIB, DEFAULT_SUBNET, DEFAULT_TIMEOUT_S, LAB_NAME, MAX_HOSTS, NODE_IMAGE
from .inventory import Inventory
from .report import (
    Output,
    render_checks,
    render_down,
    render_lab,
    render_logs,
    render_status,
    render_up,
)
from .schema import SCHEMA_VERSION
from .state import cluster_lock, state_dir, token_file
from .transport import cancel
from .transport.pool import SSHPool

if TYPE_CHECKING:
    from .checks.network import Tool
    from .status import StatusResult

# Each verb imports what only it needs (the checks, bench, up, jobs, logs, metrics, exec, the live displays)
# inside its action: `doctor`, `status` and `down` on a few hosts are mostly the interpreter's start and these imports,
# and tests/unit/test_cli_imports.py keeps them out of `import raycluster_cli.cli`.

app = typer.Typer(
    name="raycluster",
    help="Ray clusters in Docker on your own machines: doctor, up, bench, down (and a local lab to try it).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
lab_app = typer.Typer(help="A local multi-host lab (Docker-in-Docker) to try raycluster on one machine.")
app.add_typer(lab_app, name="lab")

InventoryOpt = Annotated[
    str | None,
    typer.Option("--inventory", "-i", help="inventory YAML (default: $RAYCLUSTER_INVENTORY, else ./inventory.yaml)"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON document on stdout; logs go to stderr")]
DebugOpt = Annotated[
    bool, typer.Option("--debug", help="log every remote command (host, duration, exit status) and show tracebacks")
]
IgnoreOpt = Annotated[
    str | None, typer.Option("--ignore", help="demote these failing checks to warnings: ID[,ID...] or all")
]


_INTERRUPTED_HINT = "re-run the command; `raycluster down` removes a half-started cluster"
_pools: list[SSHPool] = []  # the running verb's pool: which commands an interrupt cut short


def _running() -> list[dict[str, str]]:
    return [item for pool in _pools for item in pool.running()]


def _debug_logging(debug: bool) -> None:
    """--debug: every remote command per host with its duration and exit status, on stderr."""
    if not debug:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    handler.set_name("raycluster-debug")
    for name, level in (("raycluster", logging.DEBUG), ("paramiko", logging.WARNING)):
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.handlers = [h for h in logger.handlers if h.get_name() != "raycluster-debug"] + [handler]


def _interrupted(output: Output, state: interrupt.Interruption) -> None:
    output.error("interrupted", _INTERRUPTED_HINT)
    if output.json_mode:
        body = {"error": {"message": "interrupted", "hint": _INTERRUPTED_HINT}}
        output.document(False, body | {"interrupted": interrupt.report(state, output.events)})


def _execute(json_mode: bool, debug: bool, action: Callable[[Output], int]) -> None:
    output = Output(json_mode)
    _debug_logging(debug)

    def last_resort(state: interrupt.Interruption) -> None:
        _interrupted(output, state)
        interrupt.hard_exit(ExitCode.INTERRUPTED)

    with interrupt.handled(_running, last_resort) as state:
        try:
            code = action(output)
        except KeyboardInterrupt:
            _interrupted(output, state)
            code = ExitCode.INTERRUPTED
        except RayclusterError as exc:
            code = _failed(output, exc)
            if debug:
                raise  # after the JSON document: --json prints one, also with --debug
        except Exception as exc:
            output.error(f"unexpected {type(exc).__name__}: {exc}", "re-run with --debug and report it")
            if json_mode:
                output.document(False, {"error": {"message": str(exc), "hint": "re-run with --debug"}})
            if debug:
                raise
            code = ExitCode.FAILED
    raise typer.Exit(int(code))


def _failed(output: Output, exc: RayclusterError) -> int:
    """One line (and per-host details) on stderr; under --json the document with `ok: false`."""
    from .cluster import NodesMissing, PreflightFailed  # up's errors; only a failing run pays for the import

    output.error(exc.message, exc.hint)
    if isinstance(exc, NodesMissing):
        output.details([*exc.details, {"cause": f"joined: {', '.join(exc.joined) or 'none'}"}])
    if output.json_mode:
        body: dict[str, Any] = {"error": {"message": exc.message, "hint": exc.hint}}
        if isinstance(exc, PreflightFailed):
            body["checks"] = [r.to_dict() for r in exc.results]
        if isinstance(exc, NodesMissing):
            body["error"]["missing"] = exc.details
            body["error"]["joined"] = exc.joined
        if isinstance(exc, GroupError):
            body["error"]["hosts"] = exc.details()
        output.document(False, body)
    return exc.exit_code


@contextmanager
def _cluster(inventory_path: str | None) -> Iterator[tuple[Inventory, SSHPool]]:
    """The loaded inventory and an SSH pool to its hosts (logging in since the start: prelogin.py), closed
    afterwards."""
    ahead = prelogin.take(inventory_path)
    if ahead is None:
        loaded = inventory.load(inventory_path)
        inventory.check_key_files(loaded)
        pool = SSHPool(loaded.inventory)
    else:
        loaded, pool = ahead
    inv = loaded.inventory
    _pools.append(pool)
    try:
        yield inv, pool
    finally:
        _pools.remove(pool)
        if not cancel.requested():  # interrupted: the process ends at once and the kernel closes them all
            pool.close()


def _emit(output: Output, ok: bool, body: dict[str, Any], render: Callable[[Output, dict[str, Any]], None]) -> int:
    """The JSON document with --json, else the human rendering; the exit code for `ok`."""
    if output.json_mode:
        output.document(ok, body)
    else:
        render(output, body)
    return ExitCode.OK if ok else ExitCode.FAILED


@app.command()
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
        from .checks import Status, demote, ignore_ids, run_checks

        ignored = ignore_ids(ignore)
        if network_tool not in ("auto", "iperf3", "builtin"):
            raise UsageError(f"--network-tool {network_tool!r} is unknown", "use auto, iperf3 or builtin")
        with _cluster(inventory_path) as (inv, pool):
            results = run_checks(inv, pool, ignore=ignored)
            if network:
                from .checks.network import measure_network

                tool = cast("Tool", network_tool)
                results += demote(measure_network(inv, pool, output.progress(), tool), ignored)
        ok = not any(r.status == Status.FAIL for r in results)
        body = {"cluster": inv.cluster, "checks": [r.to_dict() for r in results]}
        return _emit(output, ok, body, lambda out, _: render_checks(out, results))

    _execute(json_mode, debug, action)


@app.command("up")
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
        from .checks import Status, ignore_ids
        from .cluster import up
        from .report_up import up_view

        ignored = ignore_ids(ignore)
        with (
            _cluster(inventory_path) as (inv, pool),
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
            "checks": [r.to_dict() for r in result.checks if r.status != Status.OK],
            "next": _next_steps(result.head, inv.ray.port, result.dashboard_url, token_file, inventory_path),
        }
        return _emit(output, result.ok, body, render_up)

    _execute(json_mode, debug, action)


def _next_steps(
    head: str, port: int, dashboard: str, token_file: str | None, inventory_path: str | None
) -> dict[str, str]:
    """Where to go after `up`: addresses and commands (the token by its file, never its value)."""
    auth = f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token_file} " if token_file else ""
    inv = f" -i {inventory_path}" if inventory_path else ""
    return {
        "ray_address": f"{head}:{port}",
        "dashboard_url": dashboard,
        "submit_job": f"{auth}ray job submit --address {dashboard} --working-dir . -- python script.py",
        "status": f"raycluster status{inv}",
        "logs": f"raycluster logs{inv}",
    }


@app.command("down")
def down_command(
    inventory_path: InventoryOpt = None,
    purge: Annotated[
        bool,
        typer.Option("--purge", help="also remove the image from the hosts and the token and files `up` made"),
    ] = False,
    json_mode: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Remove the containers that `up` started (found by this cluster's labels), and nothing else.

    The image stays on the hosts unless --purge. Exit 0: done (also when nothing was there); 1: a host failed."""

    def action(output: Output) -> int:
        from .teardown import down

        with (
            _cluster(inventory_path) as (inv, pool),
            output.live_progress() as progress,
            cluster_lock(inv, "down", progress=progress),
        ):
            result = down(inv, pool, purge=purge, progress=progress)
        body = {"cluster": inv.cluster, "removed": result.removed, "purged": result.purged, "errors": result.errors}
        return _emit(output, result.ok, body, render_down)

    _execute(json_mode, debug, action)


@app.command("status")
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
        from .status import status

        if watch and json_mode:
            raise UsageError("--watch redraws a table; --json prints one document", "use one of them")
        with _cluster(inventory_path) as (inv, pool):
            if watch:
                from .report_ops import live_status

                with live_status(output) as show:
                    repeat_until_interrupt(lambda: show(_status_body(inv, status(inv, pool))), interval)
                return ExitCode.OK
            result = status(inv, pool)
        return _emit(output, result.state == "healthy", _status_body(inv, result), render_status)

    _execute(json_mode, debug, action)


def _status_body(inv: Inventory, result: StatusResult) -> dict[str, Any]:
    return {
        "cluster": inv.cluster,
        "state": result.state,
        "hosts": [h.to_dict() for h in result.hosts],
        "totals": result.totals(),
    }


@app.command("metrics")
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
        from .metrics import collect_metrics
        from .report_ops import render_metrics

        with _cluster(inventory_path) as (inv, pool):
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
        return _emit(output, result.ok, body, render_metrics)

    _execute(json_mode, debug, action)


def _role(inv: Inventory, address: str) -> str:
    return next((h.role for h in inv.hosts if str(h.address) == address), "dashboard")


@app.command("logs")
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
        from .logs import MIB, Limits, collect

        with _cluster(inventory_path) as (inv, pool):
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
        return _emit(output, ok, body, render_logs)

    _execute(json_mode, debug, action)


@app.command("exec", context_settings={"allow_interspersed_args": False})
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
        from .ops import choose_hosts, run_exec, worst
        from .report_ops import ExecPrinter, render_exec

        with _cluster(inventory_path) as (inv, pool):
            chosen = choose_hosts(inv, host, every)
            printer = ExecPrinter(output, prefixed=len(chosen) > 1)
            results = run_exec(inv, pool, chosen, words, on_output=printer, timeout_s=timeout)
        code = worst(results)
        body = {"cluster": inv.cluster, "rc": code, "hosts": [r.to_dict() for r in results]}
        _emit(output, code == 0, body, render_exec)
        return code

    _execute(json_mode, debug, action)


@app.command("submit", context_settings={"allow_interspersed_args": False})
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
        from .jobs import Dashboard, check_dashboard, dashboard_tunnel, follow_job, stop_hint, submit_job
        from .report_ops import JobLogPrinter, render_interrupted_job, render_submit

        with _cluster(inventory_path) as (inv, pool), dashboard_tunnel(inv, pool) as (tunnel, token):
            dashboard = Dashboard(tunnel, token)
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
        _emit(output, job.code == 0, body, render_submit)
        return job.code

    _execute(json_mode, debug, action)


def wait_for_interrupt() -> None:
    """Block until Ctrl-C or SIGTERM (either ends a long-running verb normally)."""
    repeat_until_interrupt(lambda: None, 0.5)


def repeat_until_interrupt(step: Callable[[], None], interval: float) -> None:
    """Call `step` every `interval` seconds until Ctrl-C or SIGTERM (the normal end of --watch/dashboard)."""
    stopped = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    try:
        while True:
            step()
            if stopped.wait(interval):
                return
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


@app.command("dashboard")
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
        from .jobs import Dashboard, check_dashboard, dashboard_tunnel
        from .report_ops import render_dashboard

        with _cluster(inventory_path) as (inv, pool), dashboard_tunnel(inv, pool, port) as (tunnel, token):
            version = check_dashboard(Dashboard(tunnel, token))
            body = {
                "cluster": inv.cluster,
                "url": tunnel.url,
                "head_dashboard": f"{inv.head_address}:{inv.ray.dashboard_port}",
                "ray_version": version.get("ray_version", ""),
                "auth_token_file": str(token_file(inv)) if inv.ray.auth == "token" else None,
            }
            _emit(output, True, body, render_dashboard)
            wait_for_interrupt()
        return ExitCode.OK

    _execute(json_mode, debug, action)


def _flag_decl(name: str, annotation: Any) -> str:
    """``--name``, and for a switch ``--name/--no-name``."""
    flag = flag_of(name)
    return f"{flag}/--no-{flag[2:]}" if annotation is bool else flag


def _bench_parameters() -> list[inspect.Parameter]:
    """`bench`'s flags, one per field of BenchOptions (name, default, help), then the CLI's own."""
    params = [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            default=spec.default,
            annotation=Annotated[
                spec.annotation, typer.Option(_flag_decl(name, spec.annotation), help=spec.description)
            ],
        )
        for name, spec in BenchOptions.model_fields.items()
    ]
    own: dict[str, tuple[Any, Any]] = {
        "inventory_path": (InventoryOpt, None),
        "network_check": (
            Annotated[bool, typer.Option(help="measure latency, bandwidth and MTU head ↔ each worker first")],
            True,
        ),
        "timeout": (Annotated[float, typer.Option(help="seconds the whole benchmark may take")], 1800.0),
        "save_result": (Annotated[Path | None, typer.Option(help="also write the JSON result to this file")], None),
        "save_svg": (
            Annotated[Path | None, typer.Option(help="also save the report (T_i chart, sweep curves) as SVG")],
            None,
        ),
        "json_mode": (JsonOpt, False),
        "debug": (DebugOpt, False),
    }
    kind = inspect.Parameter.KEYWORD_ONLY
    return params + [inspect.Parameter(n, kind, default=d, annotation=a) for n, (a, d) in own.items()]


def _bench_options(values: dict[str, Any]) -> BenchOptions:
    """The validated options; a bad value is a usage error naming its flag."""
    given = {k: v for k, v in values.items() if v != BenchOptions.model_fields[k].default}
    try:
        return BenchOptions(**given)
    except ValidationError as exc:
        first = exc.errors()[0]
        message = str(first["msg"]).removeprefix("Value error, ")
        if not first["loc"]:  # a rule between flags: its message names them
            raise UsageError(message, "see `raycluster bench --help`") from None
        flag = flag_of(str(first["loc"][0]))
        text = f"{flag} {message}" if message.startswith("'") else f"{flag} {first['input']!r}: {message}"
        raise UsageError(text, f"see `raycluster bench --help` for what {flag} takes") from None


def bench_command(**values: Any) -> None:
    """Pipeline-parallel inference across the nodes: throughput, latency and each node's busy time.

    With no flags the run is sized to the cluster: enough layers that every node gets a share
    proportional to its measured speed, and about --duration-s of counted work. --quick: a short smoke run."""
    own = {k: values.pop(k) for k in list(values) if k not in BenchOptions.model_fields}

    def action(output: Output) -> int:
        from .bench.client import BenchFailed, run_bench
        from .checks.network import measure_network
        from .report_bench import bench_progress, render_bench, save_svg

        options = _bench_options(values)
        with _cluster(own["inventory_path"]) as (inv, pool):
            network = measure_network(inv, pool, output.progress(), seconds=1.0) if own["network_check"] else []
            output.progress()(f"running the benchmark on {len(inv.hosts)} node(s)")
            try:
                with bench_progress(output) as progress:
                    document = run_bench(inv, pool, options, timeout_s=own["timeout"], progress=progress)
            except BenchFailed as exc:
                if not exc.failure:
                    raise
                output.error(exc.message, exc.hint)
                if output.json_mode:
                    output.document(
                        False, {"error": {"message": exc.message, "hint": exc.hint}, "failure": exc.failure}
                    )
                return ExitCode.FAILED
        document["network"] = [r.to_dict() for r in network]
        document.pop("schema_version", None)
        ok = bool(document.pop("ok", True))
        if own["save_result"]:
            own["save_result"].write_text(
                json.dumps({"schema_version": SCHEMA_VERSION, "ok": ok, **document}, indent=2) + "\n"
            )
        if own["save_svg"]:
            save_svg(document, own["save_svg"])
        return _emit(output, ok, document, render_bench)

    _execute(own["json_mode"], own["debug"], action)


bench_command.__signature__ = inspect.Signature(_bench_parameters())  # type: ignore[attr-defined]
app.command("bench")(bench_command)


@lab_app.command("up")
def lab_up_command(
    hosts: Annotated[int, typer.Option("--hosts", min=1, max=MAX_HOSTS, help="how many lab hosts")] = 3,
    lab_dir: Annotated[Path | None, typer.Option("--dir", help="where the lab keeps its key and inventory")] = None,
    subnet: Annotated[str, typer.Option(help="the lab network's IPv4 subnet")] = DEFAULT_SUBNET,
    image: Annotated[str, typer.Option(help="node image to load into every lab host")] = NODE_IMAGE,
    name: Annotated[str, typer.Option(help="the lab's name (container prefix, network, label)")] = LAB_NAME,
    node_image: Annotated[
        bool, typer.Option("--node-image/--no-node-image", help="load the node image into the hosts (fleet labs: no)")
    ] = True,
    cpus: Annotated[
        list[str] | None, typer.Option(help="CPU quota of a host's Ray container, HOSTNAME=CPUS (repeatable)")
    ] = None,
    cpu_quotas: Annotated[
        str | None, typer.Option(help="CPU quotas of the hosts' Ray containers in order, e.g. 1.0,0.5,0.25")
    ] = None,
    engine: Annotated[str, typer.Option(help="the container engine in the hosts: docker or podman")] = "docker",
    json_mode: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Start N lab hosts (sshd + dockerd, or podman, each), load the node image, write their inventory."""

    def action(output: Output) -> int:
        from . import lab

        options = lab.quota_options(cpu_quotas, hosts) if cpu_quotas else {}
        for item in cpus or []:
            hostname, sep, value = item.partition("=")
            if not sep:
                raise RayclusterError(f"--cpus {item!r} is not HOSTNAME=CPUS", "e.g. --cpus lab-h2=0.5")
            options[hostname] = lab.cpu_options(value, "--cpus")
        info = lab.lab_up(
            hosts,
            lab_dir=lab_dir,
            node_image=image,
            subnet=subnet,
            name=name,
            load_node_image=node_image,
            host_options=options,
            engine=engine,
            progress=output.progress(),
        )
        if json_mode:
            output.document(True, info.to_dict())
        else:
            render_lab(output, info.to_dict())
            print(info.inventory_path, file=sys.stderr)
        return ExitCode.OK

    _execute(json_mode, debug, action)


@lab_app.command("down")
def lab_down_command(
    lab_dir: Annotated[Path | None, typer.Option("--dir", help="the lab's folder")] = None,
    keep_volumes: Annotated[bool, typer.Option(help="keep the hosts' Docker volumes (images) for next time")] = False,
    name: Annotated[str, typer.Option(help="the lab's name (container prefix, network, label)")] = LAB_NAME,
    json_mode: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Remove every lab host, the lab network and (unless kept) their volumes."""

    def action(output: Output) -> int:
        from . import lab

        removed = lab.lab_down(lab_dir=lab_dir, keep_volumes=keep_volumes, name=name, progress=output.progress())
        if json_mode:
            output.document(True, {"removed": removed})
        else:
            render_lab(output, {"removed": removed})
        return ExitCode.OK

    _execute(json_mode, debug, action)


@app.command()
def version() -> None:
    """Print raycluster's version."""
    print(__version__)


def main() -> None:
    try:
        app()
    except SystemExit as exc:
        if exc.code == ExitCode.INTERRUPTED:
            interrupt.hard_exit(ExitCode.INTERRUPTED)  # threads still waiting on a host must not hold the exit
        raise


if __name__ == "__main__":
    main()
