"""Rendering's base: `Output` (tables for people, one JSON document for programs, progress lines and bars), the helpers
every renderer shares, and the small verbs (`logs`, `lab`); doctor's findings are in checks.py, up/down/status in
lifecycle.py, the live views in up.py and operate.py, the benchmarks in bench.py and serve_bench.py.

rich is imported where it draws, not at import time: a `--json` run that prints nothing on stderr never
loads it (see tests/unit/test_cli_imports.py).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cached_property
from typing import TYPE_CHECKING, Any, TextIO

from raycluster_cli.progress import Event, HostPhase, TransferProgress
from raycluster_cli.render.text import remote_text, terminal_safe
from raycluster_cli.schema import SCHEMA_VERSION

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID
    from rich.table import Table


class Output:
    """Where results and progress go: results to stdout, progress and errors to stderr."""

    def __init__(self, json_mode: bool, stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        self.json_mode = json_mode
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self.events: list[str] = []  # every progress line so far: what an interrupted run had done
        self._documented = threading.Lock()

    @cached_property
    def out(self) -> Console:
        return _console(self.stdout)

    @cached_property
    def err(self) -> Console:
        return _console(self.stderr)

    def progress(self) -> Callable[[Event], None]:
        """A progress callback that prints one line per message (a transfer only when it is done)."""

        def sink(event: Event) -> None:
            if isinstance(event, TransferProgress):
                if not event.done:
                    return
                event = f"{event.label or 'image → ' + event.host}: {event.sent} bytes"
            text = phase_text(event)
            self.events.append(text)
            self.bullet(text)

        return sink

    @contextmanager
    def live_progress(self) -> Iterator[Callable[[Event], None]]:
        """A progress callback for lines and transfers: one bar per host receiving the image (on stderr)."""
        bars: Progress | None = None  # made at the first transfer
        tasks: dict[str, TaskID] = {}
        finished: set[str] = set()
        lock = threading.Lock()

        def sink(event: Event) -> None:
            if not isinstance(event, TransferProgress):
                self.events.append(phase_text(event))
            with lock:
                _show(event)

        def _show(event: Event) -> None:
            nonlocal bars
            if isinstance(event, TransferProgress):
                bars = bars or _transfer_bars(self.err)
                if event.host not in tasks:
                    if not bars.live.is_started:
                        bars.start()
                    description = remote_text(event.label or f"image → {event.host}")  # the bar's column is markup
                    tasks[event.host] = bars.add_task(description, total=event.total)
                bars.update(tasks[event.host], completed=event.sent, total=event.total)
                if event.done:
                    finished.add(event.host)
                if finished >= tasks.keys():
                    bars.stop()  # the finished bars stay on screen; a later group gets a fresh display
                    for task in tasks.values():
                        bars.remove_task(task)
                    tasks.clear()
                    finished.clear()
            elif bars and bars.live.is_started:
                bars.console.print(f"[dim]·[/dim] {remote_text(phase_text(event))}", markup=True)
            else:
                self.bullet(phase_text(event))

        try:
            yield sink
        finally:
            if bars is not None:
                bars.stop()

    def bullet(self, text: str) -> None:
        """One progress line on stderr: `· text`, the bullet dimmed on a terminal."""
        if self._plain_stderr():
            self.stderr.write(f"· {terminal_safe(text)}\n")
            self.stderr.flush()
        else:
            self.err.print(f"[dim]·[/dim] {remote_text(text)}", markup=True)

    def _plain_stderr(self) -> bool:
        """Whether rich would draw no style on stderr (no terminal, none forced by rich's own TTY_COMPATIBLE or
        FORCE_COLOR, no console given): then progress lines are written as they are, and a `--json` run that
        only prints those (down's) never imports rich, between two round trips to its hosts."""
        if "err" in self.__dict__ or os.environ.get("TTY_COMPATIBLE") == "1" or os.environ.get("FORCE_COLOR"):
            return False
        try:
            return not self.stderr.isatty()
        except (AttributeError, ValueError):
            return True

    def warning(self, message: str) -> None:
        self.err.print(f"[bold yellow]warning:[/bold yellow] {remote_text(message)}", markup=True)

    def details(self, items: list[dict[str, Any]]) -> None:
        """Per-host details of an error (cause and log tail), on stderr after the error line."""
        for item in items:
            self.err.print(f"  [bold]{remote_text(str(item.get('cause', item.get('host', ''))))}[/bold]", markup=True)
            for line in item.get("log_tail", [])[-8:]:
                self.err.print(f"    | {remote_text(line)}", markup=True)

    def document(self, ok: bool, body: dict[str, Any]) -> None:
        """Write the one JSON document of a --json run (only the first call writes: one document, always)."""
        if not self._documented.acquire(blocking=False):
            return
        payload = {"schema_version": SCHEMA_VERSION, "ok": ok, **body}
        self.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
        self.stdout.flush()

    def error(self, message: str, hint: str) -> None:
        """One line: what happened, then the fix."""
        fix = f" [bold]— fix:[/bold] {remote_text(hint)}" if hint else ""
        self.err.print(f"[bold red]error:[/bold red] {remote_text(message)}{fix}", markup=True, soft_wrap=True)

    def line(self, text: str) -> None:
        self.out.print(terminal_safe(text), markup=True)


def _console(file: TextIO) -> Console:
    from rich.console import Console

    return Console(file=file, highlight=False, soft_wrap=True)


def _transfer_bars(console: Console) -> Progress:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=console,
        transient=False,
    )


def _table(**options: Any) -> Table:
    from rich.table import Table

    return Table(**options)


def phase_text(event: str | HostPhase) -> str:
    """A progress line: the text itself, or `HOST ROLE: PHASE: DETAIL (J/N joined)` for a host's phase."""
    if isinstance(event, str):
        return event
    detail = f": {event.detail}" if event.detail else ""
    count = f" ({event.joined}/{event.total} joined)" if event.phase in ("joined", "failed") and event.total else ""
    return f"{event.host} {event.role}: {event.phase}{detail}{count}"


def host_error(host: str, error: str) -> str:
    """A host's error as shown after its name: without the name when the error already begins with it
    (errors raised for a host name it first; the line then reads `HOST: message`, not `HOST: HOST: message`)."""
    return error.removeprefix(f"{host}: ")


def render_logs(output: Output, body: dict[str, Any]) -> None:
    table = _table(title=f"logs in {remote_text(body['out'])}", title_justify="left")
    for column in ("host", "files", "MB", "error lines", "first error"):
        table.add_column(column)
    for host in body["hosts"]:
        first = host["error"] or (host["first_errors"][0] if host["first_errors"] else "")
        table.add_row(
            remote_text(host["host"]),
            str(host["files"]),
            f"{host['bytes'] / 1e6:.1f}",
            _mark(str(host["error_lines"]), host["error_lines"] == 0),
            remote_text(terminal_safe(host_error(host["host"], first))[:120]),
        )
    output.out.print(table)
    for host in body["hosts"]:
        for cut in host.get("truncated", []):
            output.line(f"{remote_text(host['host'])}: {remote_text(cut)}")


def render_lab(output: Output, body: dict[str, Any]) -> None:
    for host in body.get("hosts", []):
        output.line(
            f"{remote_text(host['hostname'])}  {remote_text(host['address'])}  (container {remote_text(host['name'])})"
        )
    if body.get("inventory"):
        output.line(f"inventory: {remote_text(body['inventory'])}")
    for item in body.get("removed", []):
        output.line(f"removed {remote_text(item)}")


def _rate(bps: float) -> str:
    return f"{bps / 1e9:.2f} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:.0f} Mbit/s"


def _mark(text: object, good: bool) -> str:
    return f"[green]{remote_text(text)}[/green]" if good else f"[red]{remote_text(text)}[/red]"
