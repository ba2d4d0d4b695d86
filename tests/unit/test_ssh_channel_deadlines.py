"""Waits on one SSH channel have deadlines and stay on that channel (issue 34, item 5): an sshd that never
answers the request to run a command is an error within ssh.connect_timeout_s (paramiko's exec_command waited
for ever), and one command's deadline no longer closes the host's whole connection and every other command
on it (the image copy's watcher, whose own poll could abort its copy). Real paramiko on both ends."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from raycluster_cli.errors import TransportError
from raycluster_cli.transport import CommandResult, knownhosts
from raycluster_cli.transport.ssh import SSHTransport
from raycluster_cli.transport.sshio import DeadlineExceeded
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


def _transport(pair: Pair, tmp_path: Path) -> SSHTransport:
    known = tmp_path / "known_hosts"
    known.write_text(pair.known_line())
    transport = SSHTransport(
        "192.0.2.1", key_file=str(pair.client_key_file), known_hosts_file=str(known), connect_timeout=1,
        retries=0, sock=pair.sock, keepalive_s=0,
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
