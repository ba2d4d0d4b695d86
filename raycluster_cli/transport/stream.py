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
from raycluster_cli.transport.kept import LineSplitter, Tail

Stream = Literal["stdout", "stderr"]
LineSink = Callable[[Stream, str], None]


class _Lines:
    """Passes on each complete line of one stream (the rest at the end) and keeps the stream's tail
    (transport/kept.py: bounded memory, linear time)."""

    def __init__(self, name: Stream, sink: LineSink) -> None:
        self.kept = Tail()
        self.lines = LineSplitter(lambda line: sink(name, line.decode(errors="replace")))

    def add(self, data: bytes) -> None:
        self.kept += data
        self.lines.add(data)

    def finish(self) -> str:
        self.lines.finish()
        return self.kept.text()


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
