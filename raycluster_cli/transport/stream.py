"""Run a command and hand its output to a callback line by line while it runs (for `exec`).

Over SSH the command goes through the transport's `stream` (transport/ssh.py): the same remote guard,
deadline, keepalive and Ctrl-C handling as every other command, and the lines arrive as the command
writes them. A transport without one (the fake one of the unit tests) runs the command whole and then
hands over its lines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from raycluster_cli.transport.base import CommandResult, Transport

Stream = Literal["stdout", "stderr"]
LineSink = Callable[[Stream, str], None]


class _Lines:
    """Collects bytes of one stream and passes on each complete line (the rest at the end)."""

    def __init__(self, name: Stream, sink: LineSink) -> None:
        self.name, self.sink = name, sink
        self.pending = b""
        self.text: list[str] = []

    def add(self, data: bytes) -> None:
        self.pending += data
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            self._emit(line.decode(errors="replace"))

    def finish(self) -> str:
        if self.pending:
            self._emit(self.pending.decode(errors="replace"), newline=False)
            self.pending = b""
        return "".join(self.text)

    def _emit(self, line: str, newline: bool = True) -> None:
        self.text.append(line + ("\n" if newline else ""))
        self.sink(self.name, line)


def run_streamed(transport: Transport, command: str, sink: LineSink, timeout: float | None) -> CommandResult:
    """Run `command` on the host; call `sink(stream, line)` for every output line; return the whole result."""
    lines: dict[Stream, _Lines] = {"stdout": _Lines("stdout", sink), "stderr": _Lines("stderr", sink)}
    stream = getattr(transport, "stream", None)
    if stream is None:
        result = transport.run(command, timeout=timeout)
        for name, text in (("stdout", result.stdout), ("stderr", result.stderr)):
            lines[name].add(text.encode())  # type: ignore[index]
        return CommandResult(result.rc, lines["stdout"].finish(), lines["stderr"].finish())
    rc = stream(command, lambda name, data: lines[name].add(data), timeout=timeout)
    return CommandResult(rc, lines["stdout"].finish(), lines["stderr"].finish())
