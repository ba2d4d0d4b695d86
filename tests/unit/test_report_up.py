"""`up`'s view: joined x/y and each host's phase, in place on a terminal, one line per change otherwise."""

from __future__ import annotations

import io
import re

from rich.console import Console

from raycluster_cli.progress import HostPhase, TransferProgress
from raycluster_cli.render.base import Output
from raycluster_cli.render.up import UpBoard, up_view

H2, H3 = "192.0.2.12", "192.0.2.13"


def _events() -> list[object]:
    return [
        HostPhase(H2, "worker", "checking", total=2),
        HostPhase(H3, "worker", "checking", total=2),
        "running preflight checks",
        TransferProgress(H3, 500_000_000, 943_000_000),
        TransferProgress(H3, 700_000_000, 943_000_000),
        TransferProgress(H3, 943_000_000, 943_000_000, done=True),
        HostPhase(H2, "worker", "joined", "started", joined=1, total=2),
        HostPhase(H2, "worker", "joined", "started", joined=1, total=2),  # no change: no line
        HostPhase(H3, "worker", "failed", "its container exited, exit code 1", joined=1, total=2),
    ]


def test_without_a_terminal_one_line_per_change() -> None:
    err = io.StringIO()
    with up_view(Output(False, stderr=err)) as progress:
        for event in _events():
            progress(event)  # type: ignore[arg-type]
    lines = err.getvalue().splitlines()
    assert lines == [
        f"· {H2} worker: checking",
        f"· {H3} worker: checking",
        "· running preflight checks",
        f"· image → {H3}: 943000000 bytes",
        f"· {H2} worker: joined: started (1/2 joined)",
        f"· {H3} worker: failed: its container exited, exit code 1 (1/2 joined)",
    ]


def test_the_board_shows_joined_of_total_and_the_image_bytes_of_a_receiving_host() -> None:
    board = UpBoard()
    for event in _events()[:5]:
        if not isinstance(event, str):
            board.take(event)  # type: ignore[arg-type]
    console = Console(file=io.StringIO(), width=120)
    console.print(board.render())
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "nodes joined: 0/2" in text
    assert "receiving" in text and "the image 700/943 MB" in text


def test_on_a_terminal_the_table_is_updated_in_place() -> None:
    err = io.StringIO()
    output = Output(False, stderr=err)
    output.err = Console(file=err, force_terminal=True, width=120)
    with up_view(output) as progress:
        for event in _events():
            progress(event)  # type: ignore[arg-type]
    raw = err.getvalue()
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", raw)
    assert "nodes joined: 1/2" in text and "failed" in text and "running preflight checks" in text
    assert "\x1b[2K" in raw or "\x1b[1A" in raw  # lines erased and redrawn: updated in place


def test_a_fleet_larger_than_the_terminal_shows_counts_and_the_hosts_that_need_attention_first() -> None:
    board = UpBoard()
    for i in range(200):
        phase = "failed" if i == 150 else "waiting" if i % 50 == 7 else "joined"
        board.take(
            HostPhase(f"10.0.{i // 250}.{i % 250}", "worker", phase, "why" if phase == "failed" else "", total=200)
        )  # type: ignore[arg-type]
    console = Console(file=io.StringIO(), width=120)
    console.print(board.render(height=12))
    lines = console.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert len(lines) <= 12
    assert "nodes joined: 195/200" in lines[0] and "waiting 4" in lines[0] and "failed 1" in lines[0]
    shown = "\n".join(lines)
    assert "10.0.0.150" in shown and "10.0.0.7" in shown and "10.0.0.157" in shown  # failed, then waiting
    assert "… and 192 more host(s)" in shown
    console = Console(file=io.StringIO(), width=120)
    console.print(board.render())  # no height: every host
    assert len(console.file.getvalue().splitlines()) == 202  # type: ignore[attr-defined]
