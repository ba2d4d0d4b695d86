"""Rendering: the only module that imports rich. Tables for people, one JSON document for programs."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table

from .checks import CheckResult, Status

SCHEMA_VERSION = 1
_STATUS_STYLE = {Status.FAIL: "bold red", Status.WARN: "yellow", Status.OK: "green", Status.SKIP: "dim"}
_ORDER = {Status.FAIL: 0, Status.WARN: 1, Status.SKIP: 2, Status.OK: 3}


class Output:
    """Where results and progress go: results to stdout, progress and errors to stderr."""

    def __init__(self, json_mode: bool, stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        self.json_mode = json_mode
        self.stdout = stdout or sys.stdout
        self.out = Console(file=self.stdout, highlight=False, soft_wrap=True)
        self.err = Console(file=stderr or sys.stderr, highlight=False, soft_wrap=True)

    def progress(self) -> Callable[[str], None]:
        return lambda message: self.err.print(f"[dim]·[/dim] {message}", markup=True)

    def document(self, ok: bool, body: dict[str, Any]) -> None:
        """Write the one JSON document of a --json run."""
        payload = {"schema_version": SCHEMA_VERSION, "ok": ok, **body}
        self.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
        self.stdout.flush()

    def error(self, message: str, hint: str) -> None:
        """One line: what happened, then the fix."""
        fix = f" [bold]— fix:[/bold] {_escape(hint)}" if hint else ""
        self.err.print(f"[bold red]error:[/bold red] {_escape(message)}{fix}", markup=True, soft_wrap=True)

    def line(self, text: str) -> None:
        self.out.print(text, markup=True)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def render_checks(output: Output, results: list[CheckResult]) -> None:
    """One table per host, failures first, each with its fix."""
    hosts: dict[str, list[CheckResult]] = {}
    for result in results:
        hosts.setdefault(result.host, []).append(result)
    for host, rows in hosts.items():
        table = Table(title=f"host {host}", title_justify="left", show_lines=False, expand=False)
        table.add_column("status")
        table.add_column("check")
        table.add_column("finding")
        table.add_column("fix")
        for row in sorted(rows, key=lambda r: _ORDER[r.status]):
            style = _STATUS_STYLE[row.status]
            table.add_row(
                f"[{style}]{row.status.value.upper()}[/{style}]",
                row.id,
                _escape(row.message),
                _escape(row.hint),
            )
        output.out.print(table)
    _render_network(output, results)
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
    table = Table(title="network: head ↔ each worker", title_justify="left")
    for column in ("worker", "rtt (ms)", "→ head", "← head", "MTU", "path MTU", "tool"):
        table.add_column(column)
    for host, data in measured.items():
        hop = path.get(host)
        table.add_row(
            host,
            f"{data['rtt_ms']:.3f}" if data.get("rtt_ms", -1) >= 0 else "-",
            _rate(data["to_head_bps"]),
            _rate(data["from_head_bps"]),
            str(mtu.get(host) or "?"),
            hop.status.value if hop else "-",
            str(data.get("tool", "")),
        )
    output.out.print(table)


def _rate(bps: float) -> str:
    return f"{bps / 1e9:.2f} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:.0f} Mbit/s"


def render_up(output: Output, body: dict[str, Any]) -> None:
    table = Table(title="Ray nodes", title_justify="left")
    for column in ("host", "role", "node IP", "alive", "action", "CPU", "GPU"):
        table.add_column(column)
    for node in body["nodes"]:
        resources = node.get("resources", {})
        table.add_row(
            node["host"],
            node["role"],
            node["node_ip"],
            "[green]yes[/green]" if node["alive"] else "[red]no[/red]",
            node.get("action", ""),
            f"{resources.get('CPU', 0):g}",
            f"{resources.get('GPU', 0):g}",
        )
    output.out.print(table)
    output.line(f"cluster up in {body['seconds']:.1f}s: head {body['head']}, dashboard {body['dashboard_url']}")
    if body.get("auth_token_file"):
        output.line(
            f"submit jobs with: RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={body['auth_token_file']} "
            f"ray job submit --address {body['dashboard_url']} -- python script.py"
        )


def render_down(output: Output, body: dict[str, Any]) -> None:
    if not body["removed"]:
        output.line("nothing to remove: no container of this cluster on any host")
    for item in body["removed"]:
        output.line(f"removed {item['container']} on {item['host']}")
    for item in body["errors"]:
        output.line(f"[red]not removed on {item['host']}:[/red] {_escape(item['error'])}")


def render_bench(output: Output, body: dict[str, Any]) -> None:
    stages = body.get("stages", [])
    busiest = max((s["busy_s"] for s in stages), default=0.0) or 1.0
    table = Table(title="pipeline stages (one per node)", title_justify="left")
    for column in ("stage", "host", "layers", "busy T_i (s)", ""):
        table.add_column(column)
    for stage in stages:
        bar = "█" * max(1, round(30 * stage["busy_s"] / busiest))
        extra = "+emb" if stage.get("has_embedding") else ""
        extra += "+head" if stage.get("has_head") else ""
        table.add_row(str(stage["index"]), stage["host"], f"{stage['layers']}{extra}", f"{stage['busy_s']:.3f}", bar)
    output.out.print(table)
    output.line(
        f"{body['tokens_per_s']:.1f} tokens/s, {body.get('requests_per_s', 0):.2f} requests/s "
        f"({body.get('completed', '?')}/{body.get('requests', '?')} requests in {body.get('wall_s', 0):.1f}s); "
        f"T_max − T_min = {body.get('t_max_minus_t_min_s', 0):.3f}s, imbalance {body['imbalance']:.3f}"
    )
    check = body.get("output_check")
    if check:
        verdict = "identical" if check.get("identical") else "[red]DIFFERENT[/red]"
        output.line(f"sharded vs unsharded greedy output: {verdict} ({check.get('compared_requests')} requests)")


def render_lab(output: Output, body: dict[str, Any]) -> None:
    for host in body.get("hosts", []):
        output.line(f"{host['hostname']}  {host['address']}  (container {host['name']})")
    if body.get("inventory"):
        output.line(f"inventory: {body['inventory']}")
    for item in body.get("removed", []):
        output.line(f"removed {item}")
