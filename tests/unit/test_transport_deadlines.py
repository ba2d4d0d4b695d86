"""Deadlines, stalls, keepalive, retries and cancellation of the SSH transport, against fake channels."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator

import pytest

from raycluster_cli import cancel
from raycluster_cli.errors import AuthError, TransportError
from raycluster_cli.transport import sshio
from raycluster_cli.transport.keepalive import KeepAlive
from raycluster_cli.transport.pool import LoginGate
from raycluster_cli.transport.ssh import SSHTransport

from .conftest import Clock


@pytest.fixture(autouse=True)
def _no_cancel() -> Iterator[None]:
    cancel.reset()
    yield
    cancel.reset()


class SilentChannel:
    """A channel on a host that stopped answering: no output, no exit status, no window to send into."""

    closed = False
    eof_received = False

    def __init__(self) -> None:
        self.timeout = 0.0
        self.sent = 0

    def settimeout(self, seconds: float) -> None:
        self.timeout = seconds

    def recv_ready(self) -> bool:
        return False

    def recv_stderr_ready(self) -> bool:
        return False

    def exit_status_ready(self) -> bool:
        return False

    def send(self, data: bytes) -> int:
        sshio.time.sleep(self.timeout)  # the channel's timeout passes on sshio's clock (simulated or real)
        raise TimeoutError


class SlowReader(SilentChannel):
    """A live host that reads slowly: every send takes a little time but accepts some bytes."""

    def send(self, data: bytes) -> int:
        time.sleep(0.01)
        self.sent += 1000
        return 1000


def test_a_command_that_never_ends_fails_at_its_deadline_naming_host_and_command(clock: Clock) -> None:
    started = clock.now
    with pytest.raises(sshio.DeadlineExceeded) as caught:
        sshio.collect(SilentChannel(), 0.3, "192.0.2.11", "docker exec x ray health-check")  # type: ignore[arg-type]
    assert 0.3 < clock.now - started < 0.32  # the first 10 ms turn past the deadline
    line = caught.value.one_line()
    assert "192.0.2.11" in line and "ray health-check" in line and "0s deadline" in line


def test_a_channel_closed_without_exit_status_is_an_eof() -> None:
    channel = SilentChannel()
    channel.closed = True
    with pytest.raises(EOFError):
        sshio.collect(channel, 5, "192.0.2.11")  # type: ignore[arg-type]


def test_a_stalled_stream_fails_after_the_stall_deadline(clock: Clock) -> None:
    started = clock.now
    with pytest.raises(sshio.Stalled) as caught:
        sshio.send_stream(
            SilentChannel(),  # type: ignore[arg-type]
            io.BytesIO(b"x" * 100_000),
            host="192.0.2.12",
            stall_s=0.5,
            on_sent=None,
            drain=lambda: None,
        )
    elapsed = clock.now - started
    assert 0.5 < elapsed <= 0.5 + 0.2 + 1e-6  # the first send timeout (0.2 s) that ends past the stall deadline
    assert "192.0.2.12" in caught.value.one_line() and "stalled" in caught.value.message


def test_a_slow_but_moving_stream_is_not_stalled() -> None:
    channel = SlowReader()
    sent: list[int] = []
    sshio.send_stream(
        channel,  # type: ignore[arg-type]
        io.BytesIO(b"x" * 20_000),
        host="192.0.2.12",
        stall_s=0.05,
        on_sent=sent.append,
        drain=lambda: None,
    )
    assert sum(sent) == 20_000


def test_an_interrupt_stops_a_read_at_once() -> None:
    threading.Timer(0.2, cancel.request).start()
    started = time.monotonic()
    with pytest.raises(cancel.Cancelled):
        sshio.collect(SilentChannel(), 60, "192.0.2.11")  # type: ignore[arg-type]
    assert time.monotonic() - started < 1.5


def test_an_interrupt_stops_a_stream_at_once() -> None:
    threading.Timer(0.2, cancel.request).start()
    started = time.monotonic()
    with pytest.raises(cancel.Cancelled):
        sshio.send_stream(
            SilentChannel(),  # type: ignore[arg-type]
            io.BytesIO(b"x" * 1000),
            host="192.0.2.12",
            stall_s=60,
            on_sent=None,
            drain=lambda: None,
        )
    assert time.monotonic() - started < 1.5


class Packetizer:
    def read_message(self) -> None:
        return None


class FrozenPeer:
    """A paramiko Transport whose host sends nothing (frozen) or answers every keepalive."""

    def __init__(self, answers: bool) -> None:
        self.answers = answers
        self.active = True
        self.requests = 0
        self.packetizer = Packetizer()

    def is_active(self) -> bool:
        return self.active

    def global_request(self, kind: str, wait: bool = True) -> None:
        self.requests += 1
        if self.answers:
            self.packetizer.read_message()  # the reply arrives (paramiko's thread reads it)
            return
        while self.active:
            time.sleep(0.01)

    def close(self) -> None:
        self.active = False


def test_keepalive_drops_a_host_that_stops_answering() -> None:
    peer = FrozenPeer(answers=False)
    keepalive = KeepAlive(peer, "192.0.2.13", 0.1, 3, peer.close)  # type: ignore[arg-type]
    started = time.monotonic()
    keepalive.start()
    while peer.active and time.monotonic() - started < 5:
        time.sleep(0.01)
    assert not peer.active and keepalive.declared_dead and keepalive.dead_after == pytest.approx(0.3)
    # Not before 3 × 0.1 s of silence, and asked once. No bound closer than the loop's 5 s: the keepalive's
    # thread looks every 50 ms, and a loaded machine (busy loops on both cores) once ran it 1.7 s late.
    assert time.monotonic() - started >= 0.3 and peer.requests == 1


def test_keepalive_keeps_a_host_that_answers() -> None:
    peer = FrozenPeer(answers=True)
    keepalive = KeepAlive(peer, "192.0.2.13", 0.05, 4, peer.close)  # type: ignore[arg-type]
    keepalive.start()
    deadline = time.monotonic() + 10  # not a fixed 0.8 s: a loaded machine may not run the thread that soon
    while peer.requests < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    keepalive.stop()
    assert peer.active and not keepalive.declared_dead and peer.requests >= 2


def test_keepalive_asks_nothing_while_the_host_sends_data() -> None:
    peer = FrozenPeer(answers=False)  # would never answer a keepalive ...
    # An interval far above the loop's 10 ms: a loaded machine that starves this thread for 50 ms (the old
    # interval) made the keepalive rightly ask, failing the test once in a full run at load 40.
    keepalive = KeepAlive(peer, "192.0.2.13", 1.0, 2, peer.close)  # type: ignore[arg-type]
    keepalive.start()
    started = time.monotonic()
    while time.monotonic() - started < 2.5:  # ... but streams window adjustments all the time
        peer.packetizer.read_message()
        time.sleep(0.01)
    keepalive.stop()
    assert peer.active and not keepalive.declared_dead and peer.requests == 0


def _transient(host: str) -> TransportError:
    error = TransportError(host, "connection refused on port 22")
    error.transient = True
    return error


def test_connect_retries_transient_failures_with_backoff(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    ssh = SSHTransport("192.0.2.14", known_hosts_file=str(tmp_path / "kh"), retries=2, keepalive_s=0)
    attempts: list[float] = []
    sleeps: list[float] = []
    monkeypatch.setattr(cancel, "wait", lambda s: sleeps.append(s) or False)

    def refused() -> object:
        attempts.append(time.monotonic())
        raise _transient(ssh.host)

    monkeypatch.setattr(ssh, "_connect_once", refused)
    with pytest.raises(TransportError, match="refused"):
        ssh.connect()
    assert len(attempts) == 3 and len(sleeps) == 2 and sleeps[0] < sleeps[1] <= 8 * 1.25


def test_connect_never_retries_authentication(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    ssh = SSHTransport("192.0.2.14", known_hosts_file=str(tmp_path / "kh"), retries=5, keepalive_s=0)
    attempts = []

    def denied() -> object:
        attempts.append(1)
        raise AuthError(ssh.host, "SSH authentication failed")

    monkeypatch.setattr(ssh, "_connect_once", denied)
    with pytest.raises(AuthError):
        ssh.connect()
    assert len(attempts) == 1


def test_login_gate_bounds_parallel_logins() -> None:
    gate = LoginGate(2, stagger_s=0.001)
    inside = 0
    most = 0
    lock = threading.Lock()

    def login() -> None:
        nonlocal inside, most
        with gate:
            with lock:
                inside += 1
                most = max(most, inside)
            time.sleep(0.05)
            with lock:
                inside -= 1

    threads = [threading.Thread(target=login) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most == 2


class DoneChannel:
    """A channel whose command printed `hello` and exited 0."""

    closed = False
    eof_received = True

    def __init__(self) -> None:
        self.executed = ""
        self.data = b"hello\n"

    def get_id(self) -> int:
        return 7

    def exec_command(self, command: str) -> None:
        self.executed = command

    def shutdown_write(self) -> None:
        pass

    def settimeout(self, _: float) -> None:
        pass

    def recv_ready(self) -> bool:
        return bool(self.data)

    def recv(self, size: int) -> bytes:
        data, self.data = self.data, b""
        return data

    def recv_stderr_ready(self) -> bool:
        return False

    def exit_status_ready(self) -> bool:
        return True

    def recv_exit_status(self) -> int:
        return 0

    def close(self) -> None:
        pass


class OpenClient:
    def __init__(self, channel: DoneChannel) -> None:
        self.channel = channel
        self.timeouts: list[float] = []

    def get_transport(self) -> OpenClient:
        return self

    def is_active(self) -> bool:
        return True

    def open_session(self, timeout: float | None = None, **_: object) -> DoneChannel:
        assert timeout is not None  # never paramiko's one-hour default
        self.timeouts.append(timeout)
        return self.channel


def test_every_remote_command_is_logged_with_duration_and_exit_status_and_guarded(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    ssh = SSHTransport("192.0.2.15", known_hosts_file=str(tmp_path / "kh"), connect_timeout=4)
    channel = DoneChannel()
    client = OpenClient(channel)
    ssh._client = client  # type: ignore[assignment]
    with caplog.at_level(logging.DEBUG, logger="raycluster.transport"):
        result = ssh.run("docker info --format x", timeout=30)
    assert result.rc == 0 and result.stdout == "hello\n"
    assert client.timeouts == [4]
    assert "raycluster-guard" in channel.executed and "'docker info --format x'" in channel.executed
    lines = [r.getMessage() for r in caplog.records]
    assert "192.0.2.15: $ docker info --format x" in lines
    assert any(line.startswith("192.0.2.15: exit 0 in ") and line.endswith("docker info --format x") for line in lines)


def test_a_channel_ended_by_a_lost_connection_is_not_an_exit_status() -> None:
    class Lost(DoneChannel):
        def recv_exit_status(self) -> int:
            return -1  # what paramiko reports when the connection closed under the command

        def get_transport(self) -> FrozenPeer:
            peer = FrozenPeer(answers=False)
            peer.active = False
            return peer

    with pytest.raises(EOFError):
        sshio.collect(Lost(), 5, "192.0.2.11")  # type: ignore[arg-type]
