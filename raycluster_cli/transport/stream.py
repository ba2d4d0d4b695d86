"""Run a command and hand its output to a callback line by line while it runs (for `exec`).

Over SSH the lines arrive as the command writes them; a transport without a live SSH connection (the
fake one of the unit tests) runs the command whole and then hands over its lines.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import paramiko

from ..errors import TransportError
from .base import CommandResult, Transport

Stream = Literal["stdout", "stderr"]
LineSink = Callable[[Stream, str], None]
OPEN_TIMEOUT_S = 30.0
EOF_GRACE_S = 2.0


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
    opener = getattr(transport, "paramiko_transport", None)
    if opener is None:
        result = transport.run(command, timeout=timeout)
        for name, text in (("stdout", result.stdout), ("stderr", result.stderr)):
            lines = _Lines(name, sink)  # type: ignore[arg-type]
            lines.add(text.encode())
            lines.finish()
        return result
    prepare = getattr(transport, "engine_command", None)  # the host's container engine (engine.py)
    if prepare is not None:
        command = prepare(command)
    try:
        channel = opener().open_session(timeout=OPEN_TIMEOUT_S)
    except (EOFError, paramiko.SSHException, OSError) as exc:
        raise TransportError(transport.host, f"cannot open an SSH session: {exc}", "check sshd on the host") from None
    try:
        channel.exec_command(command)
        channel.shutdown_write()
        return _pump(channel, sink, timeout, transport.host)
    except (EOFError, paramiko.SSHException, OSError) as exc:
        raise TransportError(transport.host, f"the SSH connection dropped: {exc}", "re-run the command") from None
    finally:
        channel.close()


def _pump(channel: paramiko.Channel, sink: LineSink, timeout: float | None, host: str) -> CommandResult:
    out, err = _Lines("stdout", sink), _Lines("stderr", sink)
    deadline = None if timeout is None else time.monotonic() + timeout
    exited_at: float | None = None
    channel.settimeout(0.2)
    while True:
        busy = False
        if channel.recv_ready():
            out.add(channel.recv(65536))
            busy = True
        if channel.recv_stderr_ready():
            err.add(channel.recv_stderr(65536))
            busy = True
        if busy:
            continue
        if channel.exit_status_ready():
            # sshd may send the exit status before the last output; a daemon left holding stdout never sends EOF
            exited_at = exited_at or time.monotonic()
            if channel.eof_received or time.monotonic() - exited_at > EOF_GRACE_S:
                break
        if deadline is not None and time.monotonic() > deadline:
            raise TransportError(host, f"the command ran past {timeout:.0f}s", "raise --timeout")
        time.sleep(0.02)
    return CommandResult(channel.recv_exit_status(), out.finish(), err.finish())
