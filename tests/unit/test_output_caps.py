"""Remote output kept in memory is capped, its tail kept (issue 34, item 6): a chatty host (a 40 MiB answer, a
64 MiB line without a newline) cannot exhaust the operator's memory, and splitting lines costs time in
proportion to the output (it re-split all it had on every chunk: quadratic without newlines)."""

from __future__ import annotations

import time

from raycluster_cli.transport import kept, sshio
from raycluster_cli.transport.stream import run_streamed

MIB = 1024 * 1024


class Talker:
    """A channel whose command writes `total` bytes (no newline; `line` at the very end), then exits."""

    closed = False
    eof_received = True

    def __init__(self, total: int, line: bytes = b"") -> None:
        self.left, self.line = total, line

    def settimeout(self, _: float) -> None:
        pass

    def recv_ready(self) -> bool:
        return self.left > 0

    def recv(self, size: int) -> bytes:
        size = min(size, self.left)
        self.left -= size
        data = b"x" * size
        return data[: -len(self.line)] + self.line if self.line and self.left == 0 else data

    def recv_stderr_ready(self) -> bool:
        return False

    def exit_status_ready(self) -> bool:
        return self.left == 0

    def recv_exit_status(self) -> int:
        return 0


def test_a_40_mib_answer_keeps_its_tail_only() -> None:
    result = sshio.collect(Talker(40 * MIB, line=b"the end\n"), 30, "h1", "cat big")  # type: ignore[arg-type]
    assert len(result.stdout) <= kept.MAX_KEPT + 200
    assert result.stdout.endswith("the end\n")
    assert result.stdout.startswith(f"[raycluster: the first {40 * MIB - kept.MAX_KEPT} bytes of this output")


def test_lines_of_a_64_mib_output_without_newlines_cost_linear_time_and_bounded_memory() -> None:
    seen: list[int] = []
    lines = sshio.Lines(lambda line: seen.append(len(line)))
    chunk = b"y" * 65536
    started = time.monotonic()
    for _ in range(1024):
        lines("stdout", chunk)
    lines("stdout", b"\n")
    assert time.monotonic() - started < 5
    assert max(seen) <= kept.MAX_LINE and sum(seen) == 64 * MIB
    assert len(lines.result(0).stdout) <= kept.MAX_KEPT + 200


class Streaming:
    host = "h1"

    def stream(self, command: str, on_output: sshio.OutputSink, timeout: float | None = None) -> int:
        chunk = b"y" * 65536
        for _ in range(1024):
            on_output("stdout", chunk)
        on_output("stdout", b"\nlast line\n")
        return 0


def test_exec_streaming_of_a_64_mib_line_is_linear_and_keeps_the_tail() -> None:
    seen: list[int] = []
    started = time.monotonic()
    result = run_streamed(Streaming(), "yes | tr -d '\\n'", lambda name, line: seen.append(len(line)), 30)  # type: ignore[arg-type]
    assert time.monotonic() - started < 5
    assert max(seen) <= kept.MAX_LINE and sum(seen) == 64 * MIB + len("last line")
    assert len(result.stdout) <= kept.MAX_KEPT + 200 and result.stdout.endswith("last line\n")
