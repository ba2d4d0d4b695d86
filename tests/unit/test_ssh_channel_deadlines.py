"""Waits on one SSH channel have deadlines and stay on that channel (issue 34, item 5): an sshd that never
answers the request to run a command is an error within ssh.connect_timeout_s (paramiko's exec_command waited
for ever), and one command's deadline no longer closes the host's whole connection and every other command
on it (the image copy's watcher, whose own poll could abort its copy). Real paramiko on both ends.

A host that froze is not an sshd slow to answer: one that sends nothing at all, not even an answer to the
keepalive, is reported as having stopped answering when the keepalive gives up (as on the lab's frozen hosts,
tests/e2e/test_faults_lab.py), and a command past its deadline on a silent host drops the connection."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import paramiko
import pytest

from raycluster_cli.errors import HostStoppedAnswering, TransportError
from raycluster_cli.transport import CommandResult, knownhosts
from raycluster_cli.transport.ssh import SSHTransport
from raycluster_cli.transport.sshio import DeadlineExceeded, NoExecReply, exec_within
from tests.unit.sshpair import Pair

pytestmark = pytest.mark.timeout(60)


def host(channel: paramiko.Channel, command: str) -> None:
    if command == "slow":
        time.sleep(2)
        channel.sendall(b"done\n")
        channel.send_exit_status(0)
        return
    while not channel.closed:  # yes
        channel.sendall(b"y\n" * 8192)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.setattr(knownhosts, "GLOBAL_FILES", ())
    knownhosts.forget()


def _transport(pair: Pair, tmp_path: Path, keepalive_s: float = 0) -> SSHTransport:
    known = tmp_path / "known_hosts"
    known.write_text(pair.known_line())
    transport = SSHTransport(
        "192.0.2.1", key_file=str(pair.client_key_file), known_hosts_file=str(known), connect_timeout=1,
        retries=0, sock=pair.sock, keepalive_s=keepalive_s, keepalive_count=3,
    )  # fmt: skip
    transport.guard = False
    return transport


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    served = Pair(tmp_path, on_exec=host)
    yield served
    served.close()


def test_an_sshd_that_never_answers_the_exec_request_is_an_error_within_connect_timeout(tmp_path: Path) -> None:
    held = Pair(tmp_path, on_exec=host, hold_exec=threading.Event())
    ssh = _transport(held, tmp_path)
    started = time.monotonic()
    try:
        with pytest.raises(TransportError) as info:
            ssh.run("slow", timeout=None)
    finally:
        held.close()
    assert time.monotonic() - started < 5
    assert "did not answer the request to run `slow` within 1s" in info.value.message
    assert info.value.host == "192.0.2.1"


def test_one_commands_deadline_leaves_the_other_commands_on_the_connection_running(pair: Pair, tmp_path: Path) -> None:
    ssh = _transport(pair, tmp_path)
    results: list[CommandResult | BaseException] = []

    def slow() -> None:
        try:
            results.append(ssh.run("slow", timeout=20))
        except BaseException as exc:
            results.append(exc)

    beside = threading.Thread(target=slow)
    ssh.connect()
    beside.start()
    time.sleep(0.3)
    with pytest.raises(DeadlineExceeded):
        ssh.run("yes", timeout=0.5)
    beside.join(20)
    assert len(results) == 1 and isinstance(results[0], CommandResult), results
    assert results[0].stdout == "done\n" and results[0].rc == 0
    assert ssh.run("slow", timeout=20).ok  # the same connection, no new login
    assert len(pair.servers) == 1
    ssh.close()


def test_a_host_that_sends_nothing_at_all_is_reported_as_stopped_answering_not_as_a_slow_sshd(tmp_path: Path) -> None:
    """The held exec request blocks the server's only thread: it answers nothing, keepalives included (a frozen
    host). Past connect_timeout (1 s) the wait goes on until the keepalive (0.4 s × 3) gives up."""
    held = Pair(tmp_path, on_exec=host, hold_exec=threading.Event())
    ssh = _transport(held, tmp_path, keepalive_s=0.4)
    started = time.monotonic()
    try:
        with pytest.raises(HostStoppedAnswering) as info:
            ssh.run("slow", timeout=None)
    finally:
        held.close()
    assert time.monotonic() - started < 5
    assert "stopped answering" in info.value.message and "did not answer the request" not in info.value.message


class _Unanswered:
    """A channel whose exec request is never answered, until `close()` ends the wait as a closed transport does."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def exec_command(self, line: str) -> None:
        self.closed.wait()
        raise EOFError("the connection was closed")


def test_the_exec_deadline_holds_for_a_host_heard_from_and_waits_on_for_one_that_went_silent() -> None:
    answering = _Unanswered()
    started = time.monotonic()
    with pytest.raises(NoExecReply):
        exec_within(answering, "x", "192.0.2.1", "x", 0.3, heard_since=lambda moment: True)  # type: ignore[arg-type]
    assert time.monotonic() - started < 2
    answering.closed.set()

    silent = _Unanswered()
    threading.Timer(1.0, silent.closed.set).start()  # the keepalive closes the connection
    started = time.monotonic()
    with pytest.raises(EOFError):
        exec_within(silent, "x", "192.0.2.1", "x", 0.3, heard_since=lambda moment: False)  # type: ignore[arg-type]
    assert time.monotonic() - started >= 0.9


def test_a_deadline_on_a_host_that_went_silent_drops_the_connection(tmp_path: Path) -> None:
    """Past its deadline a command on a host heard from lately closes its channel only (the test above it);
    on a host silent for two keepalive intervals the whole connection goes, so the next command logs in again."""
    served = Pair(tmp_path, on_exec=host)
    ssh = _transport(served, tmp_path, keepalive_s=30)
    try:
        ssh.connect()
        assert ssh._keepalive is not None
        # what a frozen host looks like to the keepalive before it gives up: nothing heard for 61 s (its read
        # hook taken off, so the exec reply does not count)
        del ssh.paramiko_transport().packetizer.read_message
        ssh._keepalive.last_heard -= 61
        with pytest.raises(DeadlineExceeded):
            ssh.run("slow", timeout=0.5)
        assert ssh._client is None  # dropped: the next command makes a new login
        assert ssh.run("slow", timeout=20).ok
        assert len(served.servers) == 2
    finally:
        ssh.close()
        served.close()


def _silent_sock(kept: list[socket.socket]) -> Callable[[float], socket.socket]:
    """A host whose kernel takes the connection but which sends nothing (a paused container): no SSH banner."""

    def sock(timeout: float) -> socket.socket:
        client, server = socket.socketpair()
        kept.append(server)
        return client

    return sock


def test_a_host_still_silent_at_the_next_login_is_reported_as_stopped_answering_without_retries(
    tmp_path: Path,
) -> None:
    """The command that noticed the freeze and the next one, which logs in again, say the same thing: the
    host stopped answering (up's diagnosis of a node that did not join is such a next command)."""
    held = Pair(tmp_path, on_exec=host, hold_exec=threading.Event())
    ssh = _transport(held, tmp_path, keepalive_s=0.4)
    ssh.retries = 2
    kept: list[socket.socket] = []
    try:
        with pytest.raises(HostStoppedAnswering):
            ssh.run("slow", timeout=None)
        ssh.sock = _silent_sock(kept)
        started = time.monotonic()
        with pytest.raises(HostStoppedAnswering) as info:
            ssh.run("slow", timeout=5)
        elapsed = time.monotonic() - started
    finally:
        held.close()
    message = info.value.message
    assert message.startswith("192.0.2.1: the host stopped answering (nothing received for "), message
    assert "; a new login: no SSH banner or handshake within 1s" in message, message
    assert elapsed < 2.5  # one login of 1 s, not three with backoff between them

    # A host never heard from is not said to have stopped: its first login's failure is its own.
    fresh = _transport(held, tmp_path)
    fresh.sock = _silent_sock(kept)
    with pytest.raises(TransportError) as first:
        fresh.run("slow", timeout=5)
    assert not isinstance(first.value, HostStoppedAnswering) and "no SSH banner" in first.value.message
    for server in kept:
        server.close()
