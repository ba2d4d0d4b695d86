"""A command that never pauses its output (`yes`) still ends at its deadline and on Ctrl-C (issue 34, item 4):
`collect` used to skip both checks whenever data had arrived, and `feed`'s drain read for as long as data came.
Real paramiko on both ends (tests/unit/sshpair.py); the server writes `y` lines as fast as the window allows."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from raycluster_cli import cancel
from raycluster_cli.transport import knownhosts, sshio
from raycluster_cli.transport.ssh import SSHTransport
from raycluster_cli.transport.sshio import DeadlineExceeded
from tests.unit.sshpair import Pair

pytestmark = pytest.mark.timeout(60)


def yes(channel: paramiko.Channel, command: str) -> None:
    chunk = b"y\n" * 8192
    while not channel.closed:
        channel.sendall(chunk)


@pytest.fixture
def ssh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SSHTransport]:
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.setattr(knownhosts, "GLOBAL_FILES", ())
    knownhosts.forget()
    pair = Pair(tmp_path, on_exec=yes)
    known = tmp_path / "known_hosts"
    known.write_text(pair.known_line())
    transport = SSHTransport(
        "192.0.2.1", key_file=str(pair.client_key_file), known_hosts_file=str(known), connect_timeout=5,
        retries=0, sock=pair.sock, keepalive_s=0,
    )  # fmt: skip
    transport.guard = False  # the fake sshd runs no shell: the guard's wrapper would be ignored anyway
    yield transport
    cancel.reset()
    transport.close()
    pair.close()


def _ends_within(seconds: float, call: object) -> BaseException:
    started = time.monotonic()
    with pytest.raises(BaseException) as info:
        call()  # type: ignore[operator]
    assert time.monotonic() - started < seconds, f"ran {time.monotonic() - started:.1f}s"
    return info.value


def test_run_of_a_command_that_never_pauses_ends_at_its_deadline(ssh: SSHTransport) -> None:
    error = _ends_within(6, lambda: ssh.run("yes", timeout=1))
    assert isinstance(error, DeadlineExceeded)
    assert "1s deadline" in error.message


def test_a_streamed_command_that_never_pauses_ends_at_its_deadline(ssh: SSHTransport) -> None:
    def terminal(name: str, data: bytes) -> None:
        time.sleep(0.005)  # `exec` prints every line: slower than the host writes them, so data is always ready

    error = _ends_within(6, lambda: ssh.stream("yes", terminal, timeout=1))
    assert isinstance(error, DeadlineExceeded)


class Endless:
    """A channel whose command writes without pause: a chunk is always ready (the fast host, slow reader)."""

    closed = False
    eof_received = False

    def settimeout(self, _: float) -> None:
        pass

    def recv_ready(self) -> bool:
        return True

    def recv(self, size: int) -> bytes:
        return b"y\n" * (size // 2)

    def recv_stderr_ready(self) -> bool:
        return False

    def exit_status_ready(self) -> bool:
        return False

    def send(self, data: bytes) -> int:
        raise TimeoutError  # the host reads none of its stdin


def test_collect_ends_a_command_that_never_pauses_at_its_deadline() -> None:
    chunks: list[int] = []
    error = _ends_within(3, lambda: sshio.collect(Endless(), 0.5, "h1", "yes", on_output=lambda n, d: chunks.append(1)))  # type: ignore[arg-type]
    assert isinstance(error, DeadlineExceeded) and chunks


def test_collect_stops_a_command_that_never_pauses_on_ctrl_c() -> None:
    threading.Timer(0.3, cancel.request).start()
    try:
        error = _ends_within(3, lambda: sshio.collect(Endless(), None, "h1", "yes", on_output=lambda n, d: None))  # type: ignore[arg-type]
    finally:
        cancel.reset()
    assert isinstance(error, cancel.Cancelled)


def test_send_stream_ends_at_its_deadline_while_the_command_talks_without_pause() -> None:
    channel = Endless()

    def drain() -> None:
        sshio.drain_once(channel, lambda n, d: None)  # type: ignore[arg-type]

    source = io.BytesIO(b"x" * 1024 * 1024)
    call = lambda: sshio.send_stream(  # noqa: E731
        channel,
        source,
        host="h1",
        stall_s=60,
        on_sent=None,
        drain=drain,
        deadline=time.monotonic() + 0.5,  # type: ignore[arg-type]
    )
    assert isinstance(_ends_within(3, call), DeadlineExceeded)


def test_feeding_a_command_that_never_pauses_ends_at_its_deadline(ssh: SSHTransport) -> None:
    source = io.BytesIO(b"x" * (64 * 1024 * 1024))  # more than the window: the sender waits for the host
    error = _ends_within(6, lambda: ssh.feed("yes", source, timeout=1))
    assert isinstance(error, DeadlineExceeded)


def test_ctrl_c_stops_a_command_that_never_pauses(ssh: SSHTransport) -> None:
    threading.Timer(0.5, cancel.request).start()
    error = _ends_within(4, lambda: ssh.run("yes", timeout=None))
    assert isinstance(error, cancel.Cancelled)
