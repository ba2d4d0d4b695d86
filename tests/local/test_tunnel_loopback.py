"""The tunnel's listener and byte pump on loopback: the forwarded 'channel' is a plain socket to a local
echo server, as the SSH channel is a socket-like object to the head's dashboard."""

from __future__ import annotations

import socket
import threading

import pytest

from raycluster_cli.errors import TransportError, UsageError
from raycluster_cli.transport.tunnel import Tunnel


def _echo_server() -> tuple[socket.socket, int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data.upper())

    threading.Thread(target=serve, daemon=True).start()
    return server, int(server.getsockname()[1])


def test_bytes_go_both_ways_for_each_connection_and_origins_are_passed() -> None:
    server, port = _echo_server()
    origins: list[tuple[str, int]] = []

    def open_to(origin: tuple[str, int]) -> socket.socket:
        origins.append(origin)
        return socket.create_connection(("127.0.0.1", port))

    with server, Tunnel(open_to) as tunnel:  # type: ignore[arg-type]
        for word in (b"hello", b"again"):
            with socket.create_connection(("127.0.0.1", tunnel.port), timeout=5) as client:
                client.sendall(word * 10000)
                got = b""
                while len(got) < len(word) * 10000:
                    got += client.recv(65536)
                assert got == word.upper() * 10000
    assert len(origins) == 2 and origins[0][0] == "127.0.0.1"


def test_a_channel_that_cannot_open_closes_the_client_and_is_recorded() -> None:
    def open_to(origin: tuple[str, int]) -> socket.socket:
        raise TransportError("192.0.2.11", "sshd could not connect to 192.0.2.11:8265", "is the cluster up?")

    with Tunnel(open_to) as tunnel:  # type: ignore[arg-type]
        with socket.create_connection(("127.0.0.1", tunnel.port), timeout=5) as client:
            assert client.recv(10) == b""
        assert "sshd could not connect" in tunnel.errors[0]


def test_a_port_in_use_is_a_usage_error_naming_it() -> None:
    first = Tunnel(lambda origin: socket.socket())  # type: ignore[arg-type,return-value]
    with first, pytest.raises(UsageError, match=f"127.0.0.1:{first.port}"):
        Tunnel(lambda origin: socket.socket(), first.port)  # type: ignore[arg-type,return-value]


class _Closed:
    """A paramiko transport whose connection was just closed under a request (paramiko raises EOFError)."""

    def open_channel(self, *args: object, **kwargs: object) -> None:
        raise EOFError()


class _Connection:
    def __init__(self, lost: str | None) -> None:
        self.lost = lost

    def paramiko_transport(self) -> _Closed:
        return _Closed()

    def stopped_answering(self) -> str | None:
        return self.lost


def test_a_channel_lost_with_its_host_says_the_host_stopped_answering() -> None:
    """The keepalive closed the head's connection as the channel opened (the lab's cut link, in
    tests/e2e/test_faults_tools_lab.py): the error says the host went silent, not "check AllowTcpForwarding"."""
    from raycluster_cli.errors import HostStoppedAnswering
    from raycluster_cli.transport.tunnel import forward_opener

    silent = forward_opener(_Connection("the host stopped answering (nothing received for 6s)"), "192.0.2.11", DEST)
    with pytest.raises(HostStoppedAnswering) as info:
        silent(("127.0.0.1", 5000))
    expected = "the host stopped answering (nothing received for 6s) while opening a channel to 192.0.2.11:8265"
    assert info.value.message == f"192.0.2.11: {expected}"
    other = forward_opener(_Connection(None), "192.0.2.11", DEST)
    with pytest.raises(TransportError) as info:
        other(("127.0.0.1", 5000))
    assert "AllowTcpForwarding" in info.value.hint


DEST = ("192.0.2.11", 8265)
