"""What `doctor` found, as a table per host (and the network checks as a matrix); rich imported where it draws."""

from __future__ import annotations

from typing import TYPE_CHECKING

from raycluster_cli.render.base import Output, _rate, _table
from raycluster_cli.render.text import remote_text

if TYPE_CHECKING:
    from raycluster_cli.checks import CheckResult


# By each checks.Status's value (a StrEnum: the member and its value are one key): `status` and `down` render
# no checks and do not import them.
_STATUS_STYLE = {"fail": "bold red", "warn": "yellow", "ok": "green", "skip": "dim"}


_ORDER = {"fail": 0, "warn": 1, "skip": 2, "ok": 3}


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
