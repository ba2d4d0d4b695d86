"""What every verb shares: the option types, one JSON document and exit code per run (`execute`), the
inventory and SSH pool (`open_cluster`), and the wait for Ctrl-C that ends a long-running verb."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from raycluster_cli import cancel
from raycluster_cli.cli import ahead, interrupt
from raycluster_cli.config import inventory
from raycluster_cli.config.inventory import Inventory
from raycluster_cli.errors import ExitCode, GroupError, RayclusterError
from raycluster_cli.render.base import (
    Output,
)
from raycluster_cli.transport.pool import SSHPool

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


def execute(json_mode: bool, debug: bool, action: Callable[[Output], int]) -> None:
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
    from raycluster_cli.verbs.up import (  # up's errors; only a failing run pays for the import
        NodesMissing,
        PreflightFailed,
    )

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
def open_cluster(inventory_path: str | None) -> Iterator[tuple[Inventory, SSHPool]]:
    """The loaded inventory and an SSH pool to its hosts (logging in since the start: ahead.py), closed
    afterwards."""
    taken = ahead.take(inventory_path)
    if taken is None:
        loaded = inventory.load(inventory_path)
        inventory.check_key_files(loaded)
        pool = SSHPool(loaded.inventory)
    else:
        loaded, pool = taken
    inv = loaded.inventory
    _pools.append(pool)
    try:
        yield inv, pool
    finally:
        _pools.remove(pool)
        if not cancel.requested():  # interrupted: the process ends at once and the kernel closes them all
            pool.close()


def emit(output: Output, ok: bool, body: dict[str, Any], render: Callable[[Output, dict[str, Any]], None]) -> int:
    """The JSON document with --json, else the human rendering; the exit code for `ok`."""
    if output.json_mode:
        output.document(ok, body)
    else:
        render(output, body)
    return ExitCode.OK if ok else ExitCode.FAILED


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
