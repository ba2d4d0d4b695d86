"""Rendering: the only module that imports rich. Tables for people, one JSON document for programs.

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
    from rich.console import Console, Group, RenderableType
    from rich.progress import Progress, TaskID
    from rich.table import Table

    from raycluster_cli.checks import CheckResult

# By each checks.Status's value (a StrEnum: the member and its value are one key): `status` and `down` render
# no checks and do not import them.
_STATUS_STYLE = {"fail": "bold red", "warn": "yellow", "ok": "green", "skip": "dim"}
_ORDER = {"fail": 0, "warn": 1, "skip": 2, "ok": 3}


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


def render_checks(output: Output, results: list[CheckResult]) -> None:
    """One table per host, failures first, each with its fix."""
    hosts: dict[str, list[CheckResult]] = {}
    for result in results:
        hosts.setdefault(result.host, []).append(result)
    for host, rows in hosts.items():
        table = _table(title=f"host {remote_text(host)}", title_justify="left", show_lines=False, expand=False)
        table.add_column("status")
        table.add_column("check")
        table.add_column("finding")
        table.add_column("fix")
        for row in sorted(rows, key=lambda r: _ORDER[r.status]):
            style = _STATUS_STYLE[row.status]
            table.add_row(
                f"[{style}]{row.status.value.upper()}[/{style}]",
                remote_text(row.id),
                remote_text(row.message),
                remote_text(row.hint),
            )
        output.out.print(table)
    _render_network(output, results)
    from raycluster_cli.checks import Status

    failed = sum(r.status == Status.FAIL for r in results)
    warned = sum(r.status == Status.WARN for r in results)
    verdict = "[bold red]FAILED[/bold red]" if failed else "[bold green]PASSED[/bold green]"
    output.line(f"doctor {verdict}: {failed} failure(s), {warned} warning(s) on {len(hosts)} host(s)")


def _render_network(output: Output, results: list[CheckResult]) -> None:
    """The figures of `doctor --network`, one row per worker (nothing without --network)."""
    measured = {r.host: r.data for r in results if r.id == "network" and "to_head_bps" in r.data}
    if not measured:
        return
    mtu = {r.host: r.data.get("mtu") for r in results if r.id == "mtu"}
    path = {r.host: r for r in results if r.id == "path-mtu"}
    table = _table(title="network: head ↔ each worker", title_justify="left")
    for column in ("worker", "rtt (ms)", "→ head", "← head", "MTU", "path MTU", "tool"):
        table.add_column(column)
    for host, data in measured.items():
        hop = path.get(host)
        table.add_row(
            remote_text(host),
            f"{data['rtt_ms']:.3f}" if data.get("rtt_ms", -1) >= 0 else "-",
            _rate(data["to_head_bps"]),
            _rate(data["from_head_bps"]),
            remote_text(mtu.get(host) or "?"),
            hop.status.value if hop else "-",
            remote_text(data.get("tool", "")),
        )
    output.out.print(table)


def _rate(bps: float) -> str:
    return f"{bps / 1e9:.2f} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:.0f} Mbit/s"


def render_up(output: Output, body: dict[str, Any]) -> None:
    table = _table(title="Ray nodes", title_justify="left")
    table.add_column("host", min_width=15)
    for column in ("role", "node IP", "alive", "action", "CPU", "GPU", "other resources"):
        table.add_column(column)
    for node in body["nodes"]:
        resources = node.get("resources", {})
        action = node.get("action", "")
        table.add_row(
            remote_text(node["host"]),
            remote_text(node["role"]),
            remote_text(node["node_ip"]),
            "[green]yes[/green]" if node["alive"] else "[red]no[/red]",
            remote_text(action),
            f"{resources.get('CPU', 0):g}",
            f"{resources.get('GPU', 0):g}",
            remote_text(_other_resources(resources)),
        )
    output.out.print(table)
    for node in body["nodes"]:
        if node.get("reason"):
            output.line(f"{remote_text(node['host'])}: {remote_text(node['action'])}: {remote_text(node['reason'])}")
    for item in body.get("images", []):
        output.line(
            f"image {remote_text(item['method'])}ed to {remote_text(item['host'])} ({remote_text(item['reason'])}): "
            f"{item['bytes_sent'] / 1e6:.0f} MB {remote_text(item['codec'])} in {item['seconds']:.0f}s"
            + (f" from {remote_text(item['source'])}" if item.get("source") else "")
            + (", its archive's SHA-256 checked on arrival" if item.get("checksum") == "sha256" else "")
        )
    if all(n.get("action") == "running" for n in body["nodes"]) and not body.get("images"):
        output.line("nothing to do: every node was already running as the inventory asks")
    for warning in body.get("warnings", []):
        output.line(f"[bold yellow]warning:[/bold yellow] {remote_text(warning)}")
    output.line(f"cluster up in {body['seconds']:.1f}s")
    steps = body.get("next", {})
    if steps:
        output.line("next:")
        output.line(f"  Ray address     {remote_text(steps['ray_address'])}")
        output.line(f"  dashboard       {remote_text(steps['dashboard_url'])}")
        output.line(f"  submit a job    {remote_text(steps['submit_job'])}")
        output.line(f"  health / logs   {remote_text(steps['status'])}  ·  {remote_text(steps['logs'])}")


def _other_resources(resources: dict[str, Any]) -> str:
    skip = {"CPU", "GPU", "memory", "object_store_memory"}
    return ", ".join(f"{k}={v:g}" for k, v in sorted(resources.items()) if k not in skip)


def render_down(output: Output, body: dict[str, Any]) -> None:
    if not body["removed"]:
        output.line("nothing to remove: no container of this cluster on any host")
    for item in body["removed"]:
        output.line(f"removed {remote_text(item['container'])} on {remote_text(item['host'])}")
    for item in body.get("purged", []):
        output.line(f"purged {remote_text(item['item'])} on {remote_text(item['host'])}")
    for item in body["errors"]:
        output.line(f"[red]not removed on {remote_text(item['host'])}:[/red] {remote_text(item['error'])}")


def render_status(output: Output, body: dict[str, Any]) -> None:
    output.out.print(status_view(body))


def status_view(body: dict[str, Any], title: str = "") -> Group:
    """The node table of `status` with its summary lines (also what `status --watch` redraws)."""
    title = title or f"cluster {remote_text(body['cluster'])}: {remote_text(body['state'])}"
    table = _table(title=title, title_justify="left")
    table.add_column("host", min_width=15)
    table.add_column("role")
    table.add_column("container", min_width=9)
    for column in ("Ray node", "CPU", "GPU", "other resources"):
        table.add_column(column)
    table.add_column("image", min_width=12)
    table.add_column("Ray", min_width=6)
    for host in body["hosts"]:
        resources = host.get("resources", {})
        good = {"running", "alive"}
        table.add_row(
            remote_text(host["host"]),
            remote_text(host["role"]),
            _mark(host["container"], host["container"] in good),
            _mark(host["ray_node"], host["ray_node"] in good),
            f"{resources.get('CPU', 0):g}",
            f"{resources.get('GPU', 0):g}",
            remote_text(_other_resources(resources)),
            remote_text(terminal_safe(str(host["image_id"]))[7:19]),
            remote_text(host["ray_version"]),
        )
    totals = body["totals"]
    summary = ", ".join(f"{k} {v:g}" for k, v in totals["resources"].items() if k in {"CPU", "GPU"})
    from rich.console import Group
    from rich.text import Text

    lines: list[RenderableType] = [
        table,
        Text.from_markup(f"{totals['alive_nodes']}/{totals['hosts']} nodes alive; {summary or 'no resources'}"),
    ]
    lines.extend(Text(terminal_safe(line)) for line in _model_lines(body["hosts"]))
    for host in body["hosts"]:
        if host.get("error"):
            lines.append(
                Text.from_markup(
                    f"[red]{remote_text(host['host'])}:[/red] {remote_text(host_error(host['host'], host['error']))}"
                )
            )
    service = _service_line(body.get("service"), body.get("service_error", ""))
    if service:
        lines.append(Text.from_markup(service))
    lines.extend(Text(terminal_safe(line)) for line in _live_lines((body.get("service") or {}).get("live")))
    return Group(*lines)


def _live_lines(live: dict[str, Any] | None) -> list[str]:
    """The service's pipelines now (each one's state, requests served, its stages' nodes, blocks or parts, and
    devices) and its last event."""
    if not live:
        return []
    lines = []
    for pipeline in live.get("pipelines") or []:
        stages = " | ".join(
            f"{st.get('node_ip') or '?'} "
            + (f"{st['blocks']} block(s)" if st.get("blocks") is not None else "+".join(st.get("parts") or []))
            + (f" on {st['device']}" if st.get("device") else "")
            for st in pipeline.get("stages") or []
        )
        served = pipeline.get("served", pipeline.get("images"))
        links = f", {pipeline['links']} links" if pipeline.get("links") else ""
        lines.append(f"  pipeline {pipeline.get('index')} ({pipeline.get('state')}, served {served}{links}): {stages}")
        if pipeline.get("links_note"):
            lines.append(f"    {pipeline['links_note']}")
    events = live.get("events") or []
    if events:
        last = events[-1]
        lines.append(f"  last event: {last.get('event')} {last.get('detail', '')}".rstrip())
    return lines


def _model_lines(hosts: list[dict[str, Any]]) -> list[str]:
    """One line per model held on any host: its name, digest and size, and which hosts hold it."""
    holders: dict[str, list[str]] = {}
    about: dict[str, dict[str, Any]] = {}
    for host in hosts:
        for model in host.get("models") or []:
            holders.setdefault(model["digest"], []).append(host["host"])
            about.setdefault(model["digest"], model)
    lines = []
    for digest, on in holders.items():
        model = about[digest]
        size = f", {model['size'] / 1e6:.1f} MB" if isinstance(model.get("size"), int) else ""
        lines.append(
            f"model {model.get('name') or '?'} ({terminal_safe(str(digest))[:12]}{size}) on {len(on)}/{len(hosts)}: "
            + ", ".join(on)
        )
    return lines


def _service_line(service: dict[str, Any] | None, error: str) -> str:
    """`serve`'s service in one line: its model, URL and replicas, and Ray Serve's status of it."""
    if error:
        return f"[yellow]service: could not be read: {remote_text(error)}[/yellow]"
    if not service:
        return "no service (raycluster serve --model-path DIR starts one)"
    record = service.get("record") or {}
    state = (service.get("serve") or {}).get("status") or "not deployed"
    colour = "green" if state == "RUNNING" else "yellow"
    replicas = sum(
        d.get("replicas", {}).get("RUNNING", 0)
        for d in ((service.get("serve") or {}).get("deployments") or {}).values()
    )
    what = (
        f"{remote_text(str(record.get('model', '?')))} at {remote_text(str(record.get('url', '?')))}" if record else "?"
    )
    what += " (images)" if record.get("kind") == "image" else ""
    return f"service: {what}: [{colour}]{remote_text(state)}[/{colour}], {replicas} running deployment replica(s)"


def _mark(text: object, good: bool) -> str:
    return f"[green]{remote_text(text)}[/green]" if good else f"[red]{remote_text(text)}[/red]"


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
