"""`up` as a person watches it: how many nodes joined out of how many, and each host's phase.

On a terminal one table, updated in place (rich Live): per host its role, its phase (checking, receiving the
image x/y MB, starting, waiting, joined, failed) and why. Without a terminal (a log, CI, a pipe) one line per
change on stderr. Fed by the library's progress events (progress.py); nothing here runs anything.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rich.console import Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from raycluster_cli.progress import PHASES, Event, HostPhase, TransferProgress
from raycluster_cli.render.base import Output, phase_text
from raycluster_cli.render.text import remote_text, terminal_safe

_STYLE = {
    "checking": "dim",
    "checked": "dim",
    "receiving": "cyan",
    "starting": "yellow",
    "waiting": "yellow",
    "joined": "bold green",
    "failed": "bold red",
}


@dataclass
class _Row:
    role: str
    phase: str = ""
    detail: str = ""
    sent: int = 0
    total: int = 0


class UpBoard:
    """Every host's latest phase (and image bytes): what the view shows."""

    def __init__(self) -> None:
        self.rows: dict[str, _Row] = {}
        self.compress: tuple[int, int] | None = None
        self.total = 0

    def take(self, event: HostPhase | TransferProgress) -> bool:
        """Apply an event; True when it changed what a line-per-change log would say."""
        if isinstance(event, HostPhase):
            row = self.rows.setdefault(event.host, _Row(event.role))
            changed = (row.phase, row.detail) != (event.phase, event.detail)
            row.role, row.phase, row.detail = event.role, event.phase, event.detail
            self.total = event.total or self.total
            return changed
        if event.host == "(compress)":
            self.compress = (event.sent, event.total)
            return event.done
        row = self.rows.setdefault(event.host, _Row("?"))
        row.phase, row.sent, row.total = "receiving", event.sent, event.total
        return event.done

    @property
    def joined(self) -> int:
        return sum(r.phase == "joined" for r in self.rows.values())

    def render(self, height: int = 0) -> RenderableType:
        """The view; with `height` (the terminal's lines) smaller than the fleet, the hosts still moving or
        failed come first, as many as fit, with a count per phase above them (a fleet of hundreds fits)."""
        total = self.total or len(self.rows)
        header = Text.assemble(("nodes joined: ", "bold"), (f"{self.joined}/{total}", "bold green"))
        if self.compress is not None and self.compress[0] < self.compress[1]:
            header.append(f"   compressing the image here {_mb(*self.compress)}", style="cyan")
        rows = list(self.rows.items())
        hidden = 0
        if height and len(rows) > height - 3:
            header.append("   " + "  ".join(f"{p} {n}" for p, n in self.counts().items()))
            room = max(1, height - 4)
            rows.sort(key=lambda item: _ATTENTION.get(item[1].phase, len(_ATTENTION)))
            rows, hidden = rows[:room], len(rows) - room
        table = Table(show_edge=False, box=None, pad_edge=False)
        for column in ("host", "role", "phase", ""):
            table.add_column(column, overflow="fold")
        for host, row in rows:
            detail = row.detail
            if row.phase == "receiving" and row.total:
                detail = f"the image {_mb(row.sent, row.total)}"
            phase = Text(terminal_safe(row.phase), style=_STYLE.get(row.phase, ""))
            table.add_row(remote_text(host), remote_text(row.role), phase, Text(terminal_safe(detail)))
        if hidden:
            return Group(header, table, Text(f"… and {hidden} more host(s), most of them joined", style="dim"))
        return Group(header, table)

    def counts(self) -> dict[str, int]:
        """How many hosts are in each phase (in the order of the phases), e.g. for a fleet's header."""
        found: dict[str, int] = {}
        for row in self.rows.values():
            found[row.phase] = found.get(row.phase, 0) + 1
        return {p: found[p] for p in (*PHASES, *found) if p in found}


# Which hosts a too-small terminal shows first: failed, then those still moving, the joined last.
_ATTENTION = {"failed": 0, "receiving": 1, "starting": 2, "waiting": 3, "checking": 4, "checked": 5, "joined": 6}


def _mb(sent: int, total: int) -> str:
    return f"{sent / 1e6:.0f}/{total / 1e6:.0f} MB"


def _transfer_line(event: TransferProgress) -> str:
    return f"{event.label or 'image → ' + event.host}: {event.sent} bytes"


@contextmanager
def up_view(output: Output) -> Iterator[Callable[[Event], None]]:
    """The progress callback for `up`: a live table on a terminal, else one line per change (on stderr).

    Every line said (and every phase change) also goes to `output.events`, what an interrupted run reports."""
    board = UpBoard()
    lock = threading.Lock()
    if not output.err.is_terminal:

        def line(event: Event) -> None:
            with lock:
                if isinstance(event, str) or board.take(event):
                    text = _transfer_line(event) if isinstance(event, TransferProgress) else phase_text(event)
                    output.events.append(text)
                    output.err.print(f"· {terminal_safe(text)}", markup=False, highlight=False)

        yield line
        return

    def fit() -> RenderableType:
        return board.render(output.err.size.height)

    with Live(fit(), console=output.err, refresh_per_second=4, transient=False) as live:

        def show(event: Event) -> None:
            with lock:
                if isinstance(event, str):
                    output.events.append(event)
                    live.console.print(Text.assemble(("· ", "dim"), terminal_safe(event)), highlight=False)
                elif board.take(event) and isinstance(event, HostPhase):
                    output.events.append(phase_text(event))
                live.update(fit())

        yield show
