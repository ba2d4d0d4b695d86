"""The WebSocket client (websocket.py) against a scripted server on a socket pair: the handshake, frames of
every length class, fragments, control frames, silence and the server's close."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator

import pytest

from raycluster_cli.transport.websocket import HandshakeRefused, ProtocolError, Silence, WebSocket, accept_key


def test_the_accept_key_is_rfc_6455s() -> None:
    assert accept_key("dGhlIHNhbXBsZSBub25jZQ==") == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="  # the RFC's own example (1.3)


def frame(opcode: int, payload: bytes, final: bool = True) -> bytes:
    """A server frame (unmasked)."""
    head = bytes([(0x80 if final else 0) | opcode])
    if len(payload) < 126:
        head += bytes([len(payload)])
    elif len(payload) < 65536:
        head += bytes([126]) + struct.pack("!H", len(payload))
    else:
        head += bytes([127]) + struct.pack("!Q", len(payload))
    return head + payload


def read_client_frame(sock: socket.socket) -> tuple[int, bytes]:
    first, second = sock.recv(2)
    assert second & 0x80, "a client frame must be masked"
    length = second & 0x7F
    mask = sock.recv(4)
    payload = sock.recv(length) if length else b""
    return first & 0x0F, bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    client, server = socket.socketpair()
    client.settimeout(5)
    server.settimeout(5)
    yield client, server
    client.close()
    server.close()


def handshake(client: socket.socket, server: socket.socket, accept: str | None = None) -> WebSocket:
    """The client's opening handshake, answered by a server thread (the accept key is made from the client's)."""
    request: list[bytes] = []

    def answer() -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += server.recv(4096)
        request.append(data)
        key = next(line.split(b": ", 1)[1] for line in data.split(b"\r\n") if line.startswith(b"Sec-WebSocket-Key"))
        expected = accept_key(key.decode())
        server.sendall(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            + f"Sec-WebSocket-Accept: {accept or expected}\r\n\r\n".encode()
        )

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        ws = WebSocket.open(client, "127.0.0.1:1", "/api/jobs/j/logs/tail", {"Authorization": "Bearer t0k"})
    finally:
        thread.join()
    assert request[0].startswith(b"GET /api/jobs/j/logs/tail HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer t0k\r\n" in request[0] and b"Sec-WebSocket-Version: 13" in request[0]
    return ws


def test_messages_of_every_length_class_fragments_and_pings_until_the_close(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = pair
    ws = handshake(client, server)
    big = b"x" * 70000
    server.sendall(
        frame(0x1, b"line 1\n")
        + frame(0x9, b"are you there")
        + frame(0x1, b"a" * 300)
        + frame(0x1, b"frag", final=False)
        + frame(0x0, b"ment\n")
    )
    messages = ws.messages()
    assert next(messages) == "line 1\n"
    assert next(messages) == "a" * 300
    assert read_client_frame(server) == (0xA, b"are you there")  # the ping was answered
    assert next(messages) == "fragment\n"
    server.sendall(frame(0x1, big) + frame(0x8, struct.pack("!H", 1000)))
    assert next(messages) == big.decode()
    assert list(messages) == []  # the server closed
    assert read_client_frame(server) == (0x8, struct.pack("!H", 1000))


def test_silence_loses_nothing_of_a_frame_half_received(pair: tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    ws = handshake(client, server)
    client.settimeout(0.01)
    whole = frame(0x1, b"after a pause\n")
    server.sendall(whole[:3])  # the header and one byte of the payload
    with pytest.raises(Silence):
        next(ws.messages())
    server.sendall(whole[3:])
    client.settimeout(5)
    assert next(ws.messages()) == "after a pause\n"


def test_a_refused_handshake_names_the_http_status(pair: tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    server.sendall(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n")
    with pytest.raises(HandshakeRefused) as refused:
        WebSocket.open(client, "h", "/p")
    assert refused.value.status == 401 and "401 Unauthorized" in str(refused.value)


def test_a_wrong_accept_key_or_a_dropped_connection_is_an_error(pair: tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    with pytest.raises(ProtocolError, match="Accept"):
        handshake(client, server, accept="bm90IGl0")
    other_client, other_server = socket.socketpair()
    ws = handshake(other_client, other_server)
    other_server.sendall(frame(0x1, b"partial")[:4])
    other_server.close()
    with pytest.raises(ConnectionError):
        next(ws.messages())
    other_client.close()
