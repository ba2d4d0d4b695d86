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
    failed = sum(r.status == Status.FAIL for r in results)
    warned = sum(r.status == Status.WARN for r in results)
    verdict = "[bold red]FAILED[/bold red]" if failed else "[bold green]PASSED[/bold green]"
    output.line(f"doctor {verdict}: {failed} failure(s), {warned} warning(s) on {len(hosts)} host(s)")


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


def _secs(value: Any, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _ratio(value: Any) -> str:
    return "—" if value is None else f"{value:.2f}×"


def render_bench(output: Output, body: dict[str, Any]) -> None:
    """Per-node table with a bar of busy time T_i, then throughput, latency, balance and references."""
    stages = body.get("stages", [])
    multi = len(body.get("replicas", [])) > 1
    busiest = max((s["busy_s"] for s in stages), default=0.0) or 1.0
    table = Table(title="pipeline stages (one per node)", title_justify="left")
    columns = ["replica"] if multi else []
    columns += ["stage", "host", "layers", "busy T_i (s)", "CPU (s)", "idle (s)", "predicted (s)"]
    for column in columns:
        table.add_column(column, justify="right" if "(s)" in column else "left")
    for stage in stages:
        extra = "+emb" if stage.get("has_embedding") else ""
        extra += "+head" if stage.get("has_head") else ""
        row = [str(stage.get("replica", 0))] if multi else []
        row += [
            str(stage["index"]),
            str(stage.get("host", stage.get("node_ip", "?"))),
            f"{stage['layers']}{extra}",
            f"{stage['busy_s']:.3f}",
            _secs(stage.get("cpu_s")),
            _secs(stage.get("idle_s")),
            _secs(stage.get("predicted_s")),
        ]
        table.add_row(*row)
    output.out.print(table)
    output.line("busy time T_i per node:")
    for stage in stages:
        bar = "█" * max(1, round(30 * stage["busy_s"] / busiest))
        label = f"{stage.get('host', stage.get('node_ip', '?'))} (stage {stage.get('replica', 0)}.{stage['index']})"
        output.line(f"  {_escape(label):<28} [cyan]{bar}[/cyan] {stage['busy_s']:.3f}s")
    config = body.get("config", {})
    mode = config.get("mode", "offline")
    load = f"Poisson {config.get('rate')} req/s" if mode == "poisson" else "offline"
    output.line(
        f"{body['tokens_per_s']:.1f} tokens/s, {body.get('requests_per_s', 0):.2f} requests/s "
        f"({body.get('completed', '?')}/{body.get('requests', '?')} requests in {body.get('wall_s', 0):.1f}s, {load}); "
        f"T_max − T_min = {body.get('t_max_minus_t_min_s', 0):.3f}s, imbalance {body['imbalance']:.3f}, "
        f"utilisation {body.get('utilisation', 0):.2f}"
    )
    latency = body.get("latency_s", {})
    if latency:
        lat = Table(title="latency (s, from arrival)", title_justify="left")
        for column in ("", "p50", "p90", "p99"):
            lat.add_column(column, justify="right")
        for key, label in (("ttft", "time to first token"), ("tpot", "time per output token"), ("e2e", "end to end")):
            values = latency.get(key) or {}
            lat.add_row(label, *(_secs(values.get(q), 4) for q in ("p50", "p90", "p99")))
        output.out.print(lat)
    hop = body.get("hop_overhead")
    if hop:
        output.line(f"per-hop overhead (no-op stages): {1000 * hop['per_hop_s']:.2f} ms per stage per step")
    refs = body.get("references", {})
    parts = []
    if refs.get("even"):
        parts.append(f"vs even split {_ratio(refs['even'].get('ratio'))} ({refs['even']['tokens_per_s']:.1f} tok/s)")
    if refs.get("unsharded"):
        where = refs["unsharded"].get("host", refs["unsharded"].get("node_ip", "?"))
        parts.append(
            f"vs unsharded on {where} {_ratio(refs['unsharded'].get('ratio'))} "
            f"({refs['unsharded']['tokens_per_s']:.1f} tok/s)"
        )
    if refs.get("ceiling"):
        parts.append(f"of the pipeline ceiling {_ratio(refs['ceiling'].get('ratio'))}")
    if parts:
        output.line("references (same run): " + "; ".join(parts))
    if multi:
        loads = ", ".join(
            f"#{r['index']} {r['requests']} req / {r['micro_batches']} mb" for r in body.get("replicas", [])
        )
        output.line(f"replica load (power of two choices): {loads}")
    _render_sweep(output, body.get("sweep"))
    check = body.get("output_check")
    if check:
        verdict = "identical" if check.get("identical") else "[red]DIFFERENT[/red]"
        output.line(f"sharded vs unsharded greedy output: {verdict} ({check.get('compared_requests')} requests)")


def _render_sweep(output: Output, sweep: dict[str, Any] | None) -> None:
    if not sweep:
        return
    points = sweep.get("points", [])
    if sweep.get("kind") == "batch":
        table = Table(title="sweep: micro-batch size", title_justify="left")
        for column in ("micro-batch", "tokens/s", "TTFT p50 (s)", "TPOT p50 (s)", "e2e p50 (s)"):
            table.add_column(column, justify="right")
        for p in points:
            lat = p.get("latency_s", {})
            table.add_row(
                str(p["micro_batch"]),
                f"{p['tokens_per_s']:.1f}",
                *(_secs((lat.get(k) or {}).get("p50"), 4) for k in ("ttft", "tpot", "e2e")),
            )
        output.out.print(table)
        output.line(f"best micro-batch: {sweep.get('best_micro_batch')}")
    else:
        table = Table(title="sweep: nodes", title_justify="left")
        for column in ("nodes", "tokens/s", "efficiency vs linear", "imbalance"):
            table.add_column(column, justify="right")
        for p in points:
            table.add_row(
                str(p["nodes"]), f"{p['tokens_per_s']:.1f}", f"{p['efficiency']:.2f}", f"{p['imbalance']:.3f}"
            )
        output.out.print(table)


def render_lab(output: Output, body: dict[str, Any]) -> None:
    for host in body.get("hosts", []):
        output.line(f"{host['hostname']}  {host['address']}  (container {host['name']})")
    if body.get("inventory"):
        output.line(f"inventory: {body['inventory']}")
    for item in body.get("removed", []):
        output.line(f"removed {item}")
