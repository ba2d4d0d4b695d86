"""Reading from and writing to one SSH channel, always under a deadline and always interruptible.

`collect` reads a command's output to its end (or raises at its deadline); `send_stream` writes a stream
into a command's stdin and raises when the host accepts no byte for `stall_s` seconds (a stalled stream:
a frozen host, a cut connection) — paramiko's own `sendall` would wait forever for window space.
Both poll the cancellation flag, so Ctrl-C stops them within a fraction of a second.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import BinaryIO

import paramiko

from raycluster_cli import cancel
from raycluster_cli.errors import TransportError
from raycluster_cli.transport.base import CHUNK, CommandResult
from raycluster_cli.transport.kept import LineSplitter, Tail

# How long to wait for the end of the output once the command has exited: sshd may send the exit status
# before the last of the output, and a command that leaves a daemon holding its stdout never sends EOF.
EOF_GRACE_S = 2.0
_POLL_S = 0.2  # how often a blocked read or write looks at the cancellation flag


class Stalled(TransportError):
    """A stream made no progress for its stall deadline."""


class DeadlineExceeded(TransportError):
    """A command ran past its deadline."""


class NoExecReply(DeadlineExceeded):
    """sshd did not answer the request to run a command in time."""


def exec_within(
    channel: paramiko.Channel,
    line: str,
    host: str,
    command: str,
    timeout: float,
    heard_since: Callable[[float], bool] | None = None,
) -> None:
    """`channel.exec_command(line)`, but waiting at most `timeout` for sshd's reply (paramiko's own wait has
    no deadline) and interruptible; the request itself goes out at once, in a helper thread.

    `heard_since(t)` says whether the host sent anything since `t` (the connection's keepalive). A host that
    sent nothing at all since the request went out is not a slow sshd but a host that may have stopped
    answering: the wait goes on until the keepalive decides (it closes the connection, which ends this wait,
    within its own deadline), so a frozen host is reported as one ("stopped answering"), not as an sshd
    that did not answer one request."""
    failed: list[BaseException] = []
    done = threading.Event()

    def ask() -> None:
        try:
            channel.exec_command(line)
        except BaseException as exc:  # handed to the caller's thread
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=ask, name=f"exec-request {host}", daemon=True).start()
    asked = time.monotonic()
    deadline = asked + timeout
    while not done.wait(_POLL_S):
        cancel.check(f"running a command on {host}")
        if time.monotonic() > deadline and (heard_since is None or heard_since(asked)):
            raise NoExecReply(
                host,
                f"sshd did not answer the request to run {_what(command)} within {timeout:.0f}s",
                "check that the host is up and not overloaded (sshd, load); raise ssh.connect_timeout_s for slow "
                "hosts; then re-run",
            )
    if failed:
        raise failed[0]


def close_quietly(channel: paramiko.Channel) -> None:
    """Close one channel in the background (a close to a host that stopped reading could block), leaving the
    connection and every other command on it running."""

    def close() -> None:
        with contextlib.suppress(Exception):
            channel.close()

    threading.Thread(target=close, name="channel-close", daemon=True).start()


def summary(command: str, limit: int = 60) -> str:
    """The start of a command line, for messages ("`docker load -q`")."""
    text = " ".join(command.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


OutputSink = Callable[[str, bytes], None]  # ("stdout" | "stderr", bytes as they arrive)
LineSink = Callable[[str], None]  # one line of a command's stdout (without its newline), as soon as it is whole


class Lines:
    """An OutputSink that keeps a command's output, as `collect` does without one, and hands each line of
    stdout to `on_line` the moment it is whole: a command can tell the operator something before it ends."""

    def __init__(self, on_line: LineSink | None) -> None:
        self.on_line = on_line
        self.out, self.err = Tail(), Tail()
        self._lines = LineSplitter(lambda line: on_line(line.decode(errors="replace")) if on_line else None)

    def __call__(self, stream: str, data: bytes) -> None:
        if stream == "stderr":
            self.err += data
            return
        self.out += data
        if self.on_line is not None:
            self._lines.add(data)

    def result(self, rc: int) -> CommandResult:
        return CommandResult(rc, self.out.text(), self.err.text())


def collect(
    channel: paramiko.Channel,
    timeout: float | None,
    host: str,
    command: str = "",
    *,
    on_output: OutputSink | None = None,
    stall_s: float | None = None,
    tick: Callable[[], None] | None = None,
    since: float | None = None,
) -> CommandResult:
    """Read a command's stdout and stderr until its output ends (EOF), not merely until it exits.

    With `on_output`, each chunk goes to it as it arrives and nothing is kept (the result's texts are
    empty): memory stays bounded by the channel's window whatever the output's size. With `stall_s`, a
    command that sends nothing for that long while still running fails as stalled. `tick` is called on
    every turn of the loop (the heartbeat). `timeout` counts from `since` (a time.monotonic() value; default
    now)."""
    out, err = Tail(), Tail()
    deadline = None if timeout is None else (time.monotonic() if since is None else since) + timeout
    exited_at: float | None = None
    last_data = time.monotonic()
    channel.settimeout(_POLL_S)
    while True:
        if tick is not None:
            tick()
        got = False
        if channel.recv_ready():
            got = _take(channel.recv(65536), "stdout", out, on_output)
        if channel.recv_stderr_ready():
            got = _take(channel.recv_stderr(65536), "stderr", err, on_output)
        if got:
            last_data = time.monotonic()
        elif channel.exit_status_ready():
            exited_at = exited_at or time.monotonic()
            drained = not channel.recv_ready() and not channel.recv_stderr_ready()
            if drained and (channel.eof_received or time.monotonic() - exited_at > EOF_GRACE_S):
                break
        elif getattr(channel, "closed", False):
            raise EOFError("the channel closed before the command's exit status arrived")
        elif stall_s is not None and time.monotonic() - last_data > stall_s:
            raise Stalled(
                host,
                f"{_what(command)} sent nothing for {stall_s:.0f}s (stalled)",
                "the host or the network to it stopped answering; check it and re-run "
                "(ssh.stall_timeout_s sets this deadline)",
            )
        # Judged after data too: a command that never pauses its output (`yes`) still ends at its deadline.
        _check_deadline(deadline, timeout, host, command)
        cancel.check(f"reading from {host}")
        if not got:
            time.sleep(0.01)
    rc = channel.recv_exit_status()
    if rc == -1 and _connection_lost(channel):
        # paramiko marks a channel "exited" (status -1) when its connection closes (the keepalive dropped it)
        raise EOFError("the connection closed before the command's exit status arrived")
    return CommandResult(rc, out.text(), err.text())


def _check_deadline(deadline: float | None, timeout: float | None, host: str, command: str) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise DeadlineExceeded(
            host,
            f"{_what(command)} ran past its {timeout or 0:.0f}s deadline",
            "the host is overloaded or stuck; check it, or re-run with --debug to see the command",
        )


def drain_once(channel: paramiko.Channel, on_output: OutputSink) -> None:
    """Hand on at most one chunk of each stream the command wrote meanwhile (never more: a command that writes
    without pause must not keep its caller here)."""
    if channel.recv_ready():
        on_output("stdout", channel.recv(65536))
    if channel.recv_stderr_ready():
        on_output("stderr", channel.recv_stderr(65536))


def heartbeat(channel: paramiko.Channel, every_s: float) -> Callable[[], None]:
    """A tick that writes one byte into the channel's stdin every `every_s` seconds (guard.py reads them)."""
    last = [time.monotonic()]

    def tick() -> None:
        now = time.monotonic()
        if now - last[0] >= every_s:
            last[0] = now
            with contextlib.suppress(TimeoutError, OSError, EOFError):
                channel.send(b"\n")  # no window (a silent host): the keepalive and the deadline decide

    return tick


def _take(data: bytes, name: str, kept: Tail, on_output: OutputSink | None) -> bool:
    if on_output is None:
        kept += data
    elif data:
        on_output(name, data)
    return True


def _what(command: str) -> str:
    return f"`{summary(command)}`" if command else "a command"


def _connection_lost(channel: paramiko.Channel) -> bool:
    get = getattr(channel, "get_transport", None)
    transport = get() if get is not None else None
    return transport is not None and not transport.is_active()


def send_stream(
    channel: paramiko.Channel,
    source: BinaryIO,
    *,
    host: str,
    stall_s: float,
    on_sent: Callable[[int], None] | None,
    drain: Callable[[], None],
    deadline: float | None = None,
    command: str = "",
) -> None:
    """Write all of `source` into the channel; stop early when the command exits (it failed).

    Raises Stalled when the host accepts no byte for `stall_s` seconds, DeadlineExceeded past `deadline` (a
    time.monotonic() value), Cancelled on an interrupt. `drain` is called between writes so the command's own
    output never fills its window and blocks it; it must return after a bounded read (drain_once).
    """
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    channel.settimeout(_POLL_S)
    while chunk := source.read(CHUNK):
        view = memoryview(chunk)
        last_progress = time.monotonic()
        while view:
            drain()
            if channel.exit_status_ready():
                return  # the command ended early (it failed): stop sending, its exit status says why
            cancel.check(f"streaming to {host}")
            _check_deadline(deadline, timeout, host, command)
            try:
                sent = channel.send(bytes(view[:65536]))
            except TimeoutError:
                sent = 0
            if sent:
                view = view[sent:]
                last_progress = time.monotonic()
                if on_sent is not None:
                    on_sent(sent)
            elif time.monotonic() - last_progress > stall_s:
                raise Stalled(
                    host,
                    f"the stream stalled: the host accepted no data for {stall_s:.0f}s",
                    "the host or the network to it stopped answering; check it and re-run "
                    "(ssh.stall_timeout_s sets this deadline)",
                )
