"""SSH transport over paramiko with host keys verified and a deadline on everything.

`strict` refuses a host whose key is not in known_hosts; `accept-new` records an unknown key (and still
refuses a changed one). Every failure becomes a TransportError that names the host and the fix.

Deadlines (OpenSSH's ConnectTimeout and ServerAliveInterval/CountMax are the model): connecting, the
banner and authentication each within `connect_timeout`; a keepalive that wants a reply every
`keepalive_s` (a host silent for `keepalive_s × keepalive_count` is dropped); opening a channel within
`connect_timeout`; every command within its own `timeout`; a stream that makes no progress for `stall_s`
fails. Connection refused/reset and banner timeouts (a host still booting, sshd's MaxStartups) are
retried `retries` times with a growing pause; authentication and host-key failures never are.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, BinaryIO

import paramiko

from raycluster_cli import cancel
from raycluster_cli.errors import STOPPED_ANSWERING_HINT, HostStoppedAnswering, TransportError
from raycluster_cli.transport import prefetch, sshkeys
from raycluster_cli.transport.base import CommandResult, put_command
from raycluster_cli.transport.guard import guarded
from raycluster_cli.transport.keepalive import KeepAlive
from raycluster_cli.transport.sshio import (
    DeadlineExceeded,
    Lines,
    LineSink,
    OutputSink,
    close_quietly,
    collect,
    drain_once,
    exec_within,
    heartbeat,
    send_stream,
    summary,
)

log = logging.getLogger("raycluster.transport")
logging.getLogger("paramiko").addHandler(logging.NullHandler())  # its thread's tracebacks are not for users

HEARTBEAT_S = 2.0  # a streamed command's heartbeat (see guard.py)
Sock = Callable[[float], Any]  # opens the socket to the host (e.g. through a jump host) within a timeout


class SSHTransport:
    def __init__(
        self,
        host: str,
        *,
        user: str = "root",
        port: int = 22,
        key_file: str | None = None,
        known_hosts: str = "strict",
        known_hosts_file: str = "~/.ssh/known_hosts",
        connect_timeout: float = 10.0,
        keepalive_s: float = 15.0,
        keepalive_count: int = 3,
        stall_s: float = 60.0,
        retries: int = 2,
        sock: Sock | None = None,
        gate: AbstractContextManager[None] | None = None,
    ) -> None:
        self.host = host
        self.user = user
        self.port = port
        self.key_file = os.path.expanduser(key_file) if key_file else None
        self.known_hosts = known_hosts
        self.known_hosts_file = Path(os.path.expanduser(known_hosts_file))
        self.connect_timeout = connect_timeout
        self.keepalive_s = keepalive_s
        self.keepalive_count = keepalive_count
        self.stall_s = stall_s
        self.retries = retries
        self.sock = sock
        self.guard = True  # remote commands end with their connection (see guard.py)
        self.gate = gate or contextlib.nullcontext()  # bounds logins across a pool (see pool.LoginGate)
        self._client: paramiko.SSHClient | None = None
        self._keepalive: KeepAlive | None = None
        self._lock = threading.Lock()
        self._running: dict[int, str] = {}  # channel id → command, while it runs
        self.first_read_only: prefetch.Recipe | None = None  # the recipe of the first declared read-only command
        self._ahead: dict[tuple[str, float | None], prefetch.Pending] = {}  # commands started ahead (prefetch.py)
        self._silent: str | None = None  # why the last connection was dropped, when the host had gone silent

    @property
    def target(self) -> str:
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"

    @property
    def accept_new(self) -> bool:
        return self.known_hosts == "accept-new"

    # Connecting ----------------------------------------------------------------------------------

    def connect(self) -> None:
        """Log in (once; later calls reuse the connection), retrying transient failures with backoff."""
        with self._lock:
            if self._client is not None:
                return
            attempt = 0
            while True:
                cancel.check(f"connecting to {self.host}")
                try:
                    with self.gate:
                        self._client = self._connect_once()
                    self._silent = None
                    break
                except TransportError as exc:
                    if self._silent is not None and exc.silent:
                        # the host went silent under the last connection and a new login finds it silent too:
                        # the same fault, said the same way whichever command noticed it (no retries: a frozen
                        # host would be waited on once per retry)
                        again = exc.message.removeprefix(f"{exc.host}: ")
                        raise HostStoppedAnswering(
                            self.host, f"{self._silent}; a new login: {again}", STOPPED_ANSWERING_HINT
                        ) from None
                    if not exc.transient or attempt >= self.retries:
                        raise
                    pause = min(8.0, 1.0 * 2**attempt) * random.uniform(0.75, 1.25)
                    log.debug("%s: %s; retrying in %.1fs", self.host, exc.message, pause)
                    attempt += 1
                    if cancel.wait(pause):
                        cancel.check(f"connecting to {self.host}")
            self._start_keepalive(self._client)

    def _connect_once(self) -> paramiko.SSHClient:
        key = sshkeys.load(self.key_file, self.host) if self.key_file else None
        client = paramiko.SSHClient()
        sshkeys.add_known_keys(client, self)
        started = time.monotonic()
        try:
            client.connect(
                self.host,
                port=self.port,
                username=self.user,
                pkey=key,
                timeout=self.connect_timeout,
                banner_timeout=self.connect_timeout,
                auth_timeout=self.connect_timeout,
                channel_timeout=self.connect_timeout,
                allow_agent=True,
                look_for_keys=self.key_file is None,
                passphrase=sshkeys.passphrase(),
                sock=self.sock(self.connect_timeout) if self.sock else None,
            )
        except BaseException as exc:
            client.close()
            if isinstance(exc, Exception):
                raise sshkeys.connect_error(self, exc) from None
            raise
        log.debug("%s: logged in as %s in %.2fs", self.host, self.user, time.monotonic() - started)
        return client

    def _start_keepalive(self, client: paramiko.SSHClient) -> None:
        transport = client.get_transport()
        if transport is None or self.keepalive_s <= 0:
            return
        self._keepalive = KeepAlive(transport, self.host, self.keepalive_s, self.keepalive_count, transport.close)
        self._keepalive.start()

    # Commands ------------------------------------------------------------------------------------

    def run(
        self,
        command: str,
        *,
        stdin: bytes | None = None,
        timeout: float | None = 120.0,
        on_line: LineSink | None = None,
    ) -> CommandResult:
        if on_line is not None:
            lines = Lines(on_line)
            return lines.result(self._command(command, stdin=stdin, timeout=timeout, on_output=lines).rc)
        if stdin is None:
            if self.first_read_only is None:
                self.first_read_only = prefetch.declared_read_only()
            if self._ahead:
                ahead = self._started_ahead(command, timeout)
                if ahead is not None:
                    return ahead
        return self._command(command, stdin=stdin, timeout=timeout)

    # Read-only commands started ahead (prefetch.py) ------------------------------------------------

    def expect(self, blanked: str, timeout: float | None) -> prefetch.Pending:
        """Announce that `blanked` (a read-only command the code made again: prefetch.build) will be started
        ahead on this host."""
        pending = prefetch.Pending(None)
        self._ahead[(blanked, timeout)] = pending
        return pending

    def start_ahead(self, blanked: str, timeout: float | None, pending: prefetch.Pending) -> None:
        """Run the announced command now (after the login), unless the CLI's own call came first; a failure
        to run it at all leaves no result, and the CLI's call then runs it itself, except where the host
        stopped answering under it: the CLI's call gets that error, as it would have running the command on
        this connection itself (running it again would first wait out a login to a frozen host)."""
        if not pending.claim():
            return  # the CLI asked first and runs it itself
        command, pending.marker = prefetch.fill(blanked)
        try:
            sent = time.time()
            result = self._command(command, timeout=timeout)
            pending.result = CommandResult(result.rc, result.stdout, result.stderr, (sent, time.time()))
        except HostStoppedAnswering as exc:
            pending.error = exc
        except Exception as exc:
            log.debug("%s: the command started ahead failed (%s); it runs again when asked", self.host, exc)
        finally:
            pending.done.set()

    def _started_ahead(self, command: str, timeout: float | None) -> CommandResult | None:
        blanked, marker = prefetch.shape(command)
        pending = self._ahead.pop((blanked, timeout), None)
        if pending is None or pending.claim():
            return None  # nothing started ahead, or not yet: the caller runs it (and it is never started)
        while not pending.done.wait(0.2):
            cancel.check(f"running a command on {self.host}")
        if pending.error is not None:
            raise pending.error
        if pending.result is None:
            return None
        log.debug("%s: answered by the same command started after the login: %s", self.host, summary(command))
        return prefetch.rebrand(pending.result, pending.marker, marker)

    def stream(
        self, command: str, on_output: OutputSink, *, timeout: float | None = None, stall_s: float | None = None
    ) -> int:
        """Run `command` (guarded, under `timeout`, interruptible); hand each chunk of its output to
        `on_output(stream, bytes)` as it arrives, keeping none of it; a command silent for `stall_s` fails."""
        return self._command(command, timeout=timeout, on_output=on_output, stall_s=stall_s, beat=True).rc

    def _command(
        self,
        command: str,
        *,
        stdin: bytes | None = None,
        timeout: float | None,
        on_output: OutputSink | None = None,
        stall_s: float | None = None,
        beat: bool = False,
    ) -> CommandResult:
        """One command; with `beat`, stdin carries a heartbeat that the guard watches (a cut connection
        ends the command on the host within stall_timeout_s + a margin)."""
        started = time.monotonic()
        channel = self._open_channel(command)
        beat = beat and self.guard
        try:
            line = guarded(command, timeout, heartbeat_s=self.stall_s if beat else None) if self.guard else command
            exec_within(channel, line, self.host, command, self.connect_timeout, self._heard_since)
            if stdin is not None:
                channel.settimeout(self.stall_s)
                channel.sendall(stdin)
            if not beat:
                channel.shutdown_write()
            tick = heartbeat(channel, HEARTBEAT_S) if beat else None
            result = collect(channel, timeout, self.host, command, on_output=on_output, stall_s=stall_s, tick=tick)
        except BaseException as exc:
            raise self._failed(channel, exc, command) from None
        self._finish(channel)
        log.debug("%s: exit %d in %.2fs: %s", self.host, result.rc, time.monotonic() - started, summary(command))
        return result

    def feed(
        self,
        command: str,
        source: BinaryIO,
        *,
        on_sent: Callable[[int], None] | None = None,
        timeout: float | None = None,
        on_line: LineSink | None = None,
    ) -> CommandResult:
        started = time.monotonic()
        channel = self._open_channel(command, window_size=8 * 1024 * 1024, max_packet_size=256 * 1024)
        lines = Lines(on_line)

        def drain() -> None:  # what the command says meanwhile, so that a chatty command never blocks the stream
            drain_once(channel, lines)

        deadline = None if timeout is None else started + timeout
        try:
            line = guarded(command, timeout, self.stall_s) if self.guard else command
            exec_within(channel, line, self.host, command, self.connect_timeout, self._heard_since)
            send_stream(
                channel, source, host=self.host, stall_s=self.stall_s, on_sent=on_sent, drain=drain,
                deadline=deadline, command=command,
            )  # fmt: skip
            channel.shutdown_write()
            rc = collect(channel, timeout, self.host, command, on_output=lines, since=started).rc
        except BaseException as exc:
            raise self._failed(channel, exc, command) from None
        self._finish(channel)
        log.debug("%s: exit %d in %.2fs: %s (stdin streamed)", self.host, rc, time.monotonic() - started,
                  summary(command))  # fmt: skip
        return lines.result(rc)

    def put(self, data: bytes, path: str, mode: int = 0o600) -> None:
        result = self.run(put_command(path, mode), stdin=data, timeout=60)
        if not result.ok:
            raise TransportError(self.host, f"cannot write {path}: {result.first_line()}", "check disk and permissions")

    def paramiko_transport(self) -> paramiko.Transport:
        """This host's live SSH connection (made on first use): for forwarded ports and streamed sessions."""
        self.connect()
        client = self._client
        transport = client.get_transport() if client is not None else None
        if transport is None or not transport.is_active():
            lost = self.stopped_answering()
            self._forget()
            if lost:
                raise HostStoppedAnswering(self.host, lost, STOPPED_ANSWERING_HINT)
            raise TransportError(self.host, "SSH connection was lost", "check the host and retry")
        return transport

    def stopped_answering(self) -> str | None:
        """Why the connection ended when its keepalive ended it (the host went silent), else None: for the
        users of its channels (a forwarded port), whose own errors would only say the channel failed."""
        keepalive = self._keepalive
        if keepalive is not None and keepalive.declared_dead:
            return f"the host stopped answering (nothing received for {keepalive.dead_after:.0f}s)"
        return None

    def running(self) -> list[str]:
        """The commands running on this host now (what an interrupted run had started)."""
        return list(self._running.values())

    def close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.stop()
            self._keepalive = None
        if self._client is not None:
            self._client.close()
            self._client = None

    # Channels ------------------------------------------------------------------------------------

    def _open_channel(self, command: str, **options: int) -> paramiko.Channel:
        """A session on this host's connection (made on first use), opened within connect_timeout."""
        cancel.check(f"running a command on {self.host}")
        self.connect()
        log.debug("%s: $ %s", self.host, command)
        client = self._client
        transport = client.get_transport() if client is not None else None
        if transport is None or not transport.is_active():
            raise self._dropped(EOFError("the connection is closed"), command)
        try:
            channel = transport.open_session(timeout=self.connect_timeout, **options)
        except (EOFError, paramiko.SSHException, OSError) as exc:
            raise self._dropped(exc, command) from None
        self._running[channel.get_id()] = command
        return channel

    def _heard_since(self, moment: float) -> bool:
        """Whether the host sent anything since `moment` (always true without a keepalive to decide)."""
        keepalive = self._keepalive
        return keepalive is None or keepalive.last_heard > moment

    def _finish(self, channel: paramiko.Channel) -> None:
        self._running.pop(channel.get_id(), None)
        channel.close()

    def _failed(self, channel: paramiko.Channel, exc: BaseException, command: str) -> BaseException:
        """A command did not end normally: return the error to raise. Past its own deadline (or sshd's reply to
        run it), only its channel is closed, in the background: the connection and every other command on it
        go on, and the closed session ends the command on the host (guard.py). Otherwise (stall, lost
        connection, interrupt) the whole connection is dropped: a closed connection ends every session."""
        self._running.pop(channel.get_id(), None)
        keepalive = self._keepalive
        # the host answered within two keepalive intervals (it is asked after one of silence, checked every half):
        # it is this command that ran long, not the host that froze (a frozen host's
        # connection is dropped as before, so the next command logs in again instead of waiting on it)
        alive = keepalive is None or (
            not keepalive.declared_dead and time.monotonic() - keepalive.last_heard < 2 * keepalive.interval
        )
        if isinstance(exc, DeadlineExceeded) and alive:
            close_quietly(channel)
            return exc
        if isinstance(exc, TransportError | KeyboardInterrupt) or not isinstance(exc, Exception):
            if isinstance(exc, TransportError) and self._keepalive is not None and self._keepalive.declared_dead:
                return self._dropped(exc, command)
            if isinstance(exc, DeadlineExceeded) and keepalive is not None:
                silent_s = time.monotonic() - keepalive.last_heard
                self._silent = f"the host stopped answering (nothing received for {silent_s:.0f}s)"
            self._forget()
            return exc
        return self._dropped(exc, command)

    def _dropped(self, exc: BaseException, command: str) -> TransportError:
        """The connection died under a command: forget it (the next call reconnects) and say why in one line."""
        lost = self.stopped_answering()
        self._silent = lost
        self._forget()
        what = f"`{summary(command)}`"
        if lost:
            return HostStoppedAnswering(self.host, f"{lost} during {what}", STOPPED_ANSWERING_HINT)
        if isinstance(exc, paramiko.ChannelException):
            return TransportError(
                self.host,
                f"sshd refused a session for {what} ({exc})",
                "check sshd's MaxSessions and the host's load, and re-run",
            )
        if "opening channel" in str(exc).lower():
            return HostStoppedAnswering(
                self.host,
                f"the host stopped answering: no SSH channel for {what} within {self.connect_timeout:.0f}s",
                STOPPED_ANSWERING_HINT,
            )
        return TransportError(
            self.host,
            f"the SSH connection dropped during {what} ({type(exc).__name__}: {exc or 'no detail'})",
            "re-run; if it repeats, check sshd (MaxStartups, MaxSessions) and free memory on the host",
        )

    def _forget(self) -> None:
        try:
            self.close()
        except Exception:  # closing a dead connection may fail in its own way: it is gone either way
            self._client = None
