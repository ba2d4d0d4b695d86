"""The Typer application: every verb registered from its group's module (`raycluster --help` lists them)."""

from __future__ import annotations

import typer

from raycluster_cli.cli import bench, lab, lifecycle, nodes, operate, serve
from raycluster_cli.cli.interrupt import hard_exit
from raycluster_cli.errors import ExitCode

# Each verb imports what only it needs (the checks, bench, up, jobs, logs, metrics, exec, the live displays)
# inside its action: `doctor`, `status` and `down` on a few hosts are mostly the interpreter's start and these imports,
# and tests/unit/test_cli_imports.py keeps them out of `import raycluster_cli.cli.app`.

app = typer.Typer(
    name="raycluster",
    help="Ray clusters in Docker on your own machines: doctor, up, bench, down (and a local lab to try it).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.command()(lifecycle.doctor)
app.command("up")(lifecycle.up_command)
app.command("down")(lifecycle.down_command)
app.command("status")(lifecycle.status_command)
app.command("drain")(nodes.drain_command)
app.command("undrain")(nodes.undrain_command)
app.command("metrics")(operate.metrics_command)
app.command("logs")(operate.logs_command)
app.command("exec", context_settings={"allow_interspersed_args": False})(operate.exec_command)
app.command("submit", context_settings={"allow_interspersed_args": False})(operate.submit_command)
app.command("dashboard")(operate.dashboard_command)
app.command("bench")(bench.bench_command)
app.command("serve")(serve.serve_command)
lab_app = typer.Typer(help="A local multi-host lab (Docker-in-Docker) to try raycluster on one machine.")
app.add_typer(lab_app, name="lab")
lab_app.command("up")(lab.lab_up_command)
lab_app.command("down")(lab.lab_down_command)
app.command()(lifecycle.version)


def main() -> None:
    try:
        app()
    except SystemExit as exc:
        if exc.code == ExitCode.INTERRUPTED:
            hard_exit(ExitCode.INTERRUPTED)  # threads still waiting on a host must not hold the exit
        raise
