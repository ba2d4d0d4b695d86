"""The image copy's listener (image/peer_copy.py's LISTENER, run as the sender runs it: `python3 -c`, the
secret on stdin) with real sockets on loopback (issue 34, item 16): it took connections one at a time and gave
each 10 s to present the transfer's secret, so a few connections that said nothing outlasted its wait and the
real receiver was never served."""

from __future__ import annotations

import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from raycluster_cli.delivery import peer_copy

HELLO_S = getattr(peer_copy, "HELLO_S", 5.0)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Listener:
    def __init__(self, tmp: Path, wait_s: float = 20.0) -> None:
        self.archive = tmp / "archive.zst"
        self.archive.write_bytes(secrets.token_bytes(3 << 20))
        self.secret = secrets.token_hex(24)
        self.answer = secrets.token_hex(24)  # what it says back first: the receiver's proof that it is the sender
        self.port = _free_port()
        argv = [
            "127.0.0.1",
            self.port,
            self.archive,
            60,
            wait_s,
            getattr(peer_copy, "HELLO_S", 5.0),
            getattr(peer_copy, "PENDING", 64),
        ]
        self.process = subprocess.Popen(
            [sys.executable, "-c", peer_copy.LISTENER, *map(str, argv)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert self.process.stdin is not None
        self.process.stdin.write(f"{self.secret}\n{self.answer}\n".encode())
        self.process.stdin.close()
        self.process.stdin = None  # written and closed: communicate() has nothing to send
        deadline = time.monotonic() + 10
        while True:  # until it listens (a probe that says nothing: dropped after HELLO_S)
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                assert time.monotonic() < deadline, "the listener never listened"
                time.sleep(0.05)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def receive(self, line: bytes) -> bytes:
        """What a receiver that presents `line` gets."""
        with self.connect() as conn:
            conn.settimeout(5)
            conn.sendall(line)
            chunks = []
            try:
                while chunk := conn.recv(1 << 16):
                    chunks.append(chunk)
            except ConnectionResetError:  # closed with our bytes unread
                pass
        return b"".join(chunks)


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[Listener]:
    made = Listener(tmp_path)
    yield made
    if made.process.poll() is None:
        made.process.kill()
    made.process.wait(10)


def test_connections_that_say_nothing_do_not_keep_the_receiver_out(listener: Listener) -> None:
    silent = [listener.connect() for _ in range(4)]
    try:
        start = time.monotonic()
        expected = f"{listener.answer}\n".encode() + listener.archive.read_bytes()
        assert listener.receive(f"{listener.secret}\n".encode()) == expected
        assert time.monotonic() - start < 4  # was: 10 s per silent connection ahead of it, past the wait
    finally:
        for conn in silent:
            conn.close()
    out, _ = listener.process.communicate(timeout=10)
    assert listener.process.returncode == 0 and int(out) == listener.archive.stat().st_size


def test_wrong_secrets_and_half_lines_are_dropped_and_the_right_one_served(listener: Listener) -> None:
    half = listener.connect()
    half.sendall(listener.secret[:10].encode())  # a line never finished
    try:
        assert listener.receive(b"0" * 48 + b"\n") == b""  # a wrong secret: closed, nothing sent
        assert listener.receive(b"x" * 300) == b""  # no newline within 200 bytes: closed
        expected = f"{listener.answer}\n".encode() + listener.archive.read_bytes()
        assert listener.receive(f"{listener.secret}\n".encode()) == expected
    finally:
        half.close()


def test_a_silent_connection_is_closed_after_the_hello_deadline(tmp_path: Path) -> None:
    listener = Listener(tmp_path)
    try:
        with listener.connect() as conn:
            conn.settimeout(HELLO_S + 5)
            start = time.monotonic()
            assert conn.recv(1) == b""
            assert time.monotonic() - start < HELLO_S + 2
    finally:
        listener.process.kill()
        listener.process.wait(10)


def test_nobody_with_the_secret_ends_the_listener_after_its_wait(tmp_path: Path) -> None:
    listener = Listener(tmp_path, wait_s=1.0)
    _, err = listener.process.communicate(timeout=10)
    assert listener.process.returncode == 1 and b"no receiver presented the transfer's secret in time" in err
