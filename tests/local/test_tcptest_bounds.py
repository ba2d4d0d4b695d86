"""`doctor --network`'s built-in test server (checks/tcptest.py) with real sockets on loopback (issue 34, item
16): it answered one connection at a time with no deadline, so a connection that said nothing held up every
other for good, and a download asked for `inf` (or 1e9) seconds streamed forever."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from raycluster_cli.checks import tcptest


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def server() -> Iterator[int]:
    port = _free_port()
    thread = threading.Thread(target=tcptest.serve, args=("127.0.0.1", port, 30.0), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while True:  # until it listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "the test server never listened"
            time.sleep(0.05)
    yield port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"Q")
    thread.join(10)
    assert not thread.is_alive(), "Q did not end the server"


def _ping(port: int) -> float:
    """Seconds until a ping connection's first echo."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.settimeout(5)
        conn.sendall(b"P")
        conn.sendall(b"x")
        assert conn.recv(64) == b"x"
    return time.monotonic() - start


def _streamed_for(port: int, request: bytes, limit_s: float) -> tuple[int, float]:
    """Bytes a download request received and the seconds until the server ended it (at most limit_s)."""
    start = time.monotonic()
    received = 0
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(request)
        conn.settimeout(1)
        while time.monotonic() - start < limit_s:
            try:
                chunk = conn.recv(1 << 16)
            except TimeoutError:
                continue
            if not chunk:
                break
            received += len(chunk)
    return received, time.monotonic() - start


def test_connections_that_say_nothing_hold_up_no_other(server: int) -> None:
    silent = [socket.create_connection(("127.0.0.1", server), timeout=5) for _ in range(3)]
    try:
        assert _ping(server) < 2  # was: never (the server waited on the first silent connection's mode byte)
    finally:
        for conn in silent:
            conn.close()


def test_a_silent_connection_is_closed_after_the_io_deadline(server: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcptest, "IO_S", 0.3, raising=False)
    with socket.create_connection(("127.0.0.1", server), timeout=5) as conn:
        conn.settimeout(5)
        start = time.monotonic()
        assert conn.recv(1) == b""  # closed by the server
        assert time.monotonic() - start < 3


@pytest.mark.parametrize("asked", [b"1e9", b"inf", b"nan", b"-1", b"x"])
def test_a_download_lasts_at_most_the_bound_whatever_it_asks(
    server: int, monkeypatch: pytest.MonkeyPatch, asked: bytes
) -> None:
    monkeypatch.setattr(tcptest, "MAX_SECONDS", 0.5, raising=False)
    received, took = _streamed_for(server, b"D" + asked.ljust(15), limit_s=8)
    assert took < 4, f"D {asked!r} still streaming after {took:.1f}s"
    if asked == b"1e9":
        assert received > 0  # a real download, cut at the bound


def test_more_connections_than_the_bound_are_closed_and_the_server_goes_on(
    server: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = [
        socket.create_connection(("127.0.0.1", server), timeout=5)
        for _ in range(getattr(tcptest, "MAX_CONNECTIONS", 8))
    ]
    try:
        time.sleep(0.3)  # let the server accept them all
        with socket.create_connection(("127.0.0.1", server), timeout=5) as extra:
            extra.settimeout(5)
            assert extra.recv(1) == b""  # closed at once
    finally:
        for conn in held:
            conn.close()
    deadline = time.monotonic() + 5
    while True:  # the slots come back as the server notices the closed connections
        try:
            assert _ping(server) < 2
            break
        except (AssertionError, OSError):
            assert time.monotonic() < deadline
            time.sleep(0.1)
