"""A minimal WebSocket client (RFC 6455) for one purpose: reading the text messages a server pushes.

Ray's dashboard follows a job's log only over a WebSocket (`/api/jobs/<id>/logs/tail`, what the job SDK's
`tail_job_logs` reads); its REST route returns the whole log on every call. The operator install has
neither Ray nor aiohttp, so this is the standard library's socket: the opening handshake (with the
Authorization header, inside the SSH tunnel), then frames read until the server closes. Control frames are
answered (pong, close); the client sends nothing else.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import socket
import struct
from collections.abc import Iterator

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455, section 1.3
_TEXT, _BINARY, _CONTINUATION, _CLOSE, _PING, _PONG = 0x1, 0x2, 0x0, 0x8, 0x9, 0xA
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class HandshakeRefused(Exception):
    """The server answered the opening handshake with an HTTP status other than 101."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"HTTP {status} {reason}".strip())
        self.status = status


class ProtocolError(Exception):
    """The server broke the protocol (a bad accept key, an oversized or malformed frame)."""


class Silence(Exception):
    """No frame within the socket's timeout; the connection is still usable."""


class WebSocket:
    """A connected client: `messages()` yields each text message until the server closes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.parts: list[bytes] = []  # the frames so far of a fragmented message

    @classmethod
    def open(cls, sock: socket.socket, host: str, path: str, headers: dict[str, str] | None = None) -> WebSocket:
        """Do the opening handshake on a connected socket (its timeout bounds every read)."""
        key = base64.b64encode(os.urandom(16)).decode()
        lines = [
            f"GET {path} HTTP/1.1",
            f"Host: {host}",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Key: {key}",
            "Sec-WebSocket-Version: 13",
            *(f"{name}: {value}" for name, value in (headers or {}).items()),
        ]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        client = cls(sock)
        head = client._read_until(b"\r\n\r\n").decode("latin-1")
        status_line, *header_lines = head.split("\r\n")
        parts = status_line.split(" ", 2)
        status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        if status != 101:
            raise HandshakeRefused(status, parts[2] if len(parts) > 2 else "")
        answered = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
        if answered.get("sec-websocket-accept") != accept_key(key):
            raise ProtocolError("the server's Sec-WebSocket-Accept does not match the key")
        return client

    def messages(self) -> Iterator[str]:
        """Each text (or binary, decoded as UTF-8) message; ends when the server closes the connection.
        Raises Silence when no frame came within the socket's timeout: nothing is lost, and a new
        `messages()` goes on where this one stopped."""
        while True:
            final, opcode, payload = self._frame()
            if opcode == _CLOSE:
                self._send(_CLOSE, payload[:2])
                return
            if opcode == _PING:
                self._send(_PONG, payload)
                continue
            if opcode == _PONG:
                continue
            if opcode not in (_TEXT, _BINARY, _CONTINUATION):
                raise ProtocolError(f"unknown opcode {opcode}")
            self.parts.append(payload)
            if sum(len(p) for p in self.parts) > MAX_MESSAGE_BYTES:
                raise ProtocolError(f"a message over {MAX_MESSAGE_BYTES} bytes")
            if final:
                message, self.parts = b"".join(self.parts), []
                yield message.decode(errors="replace")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._send(_CLOSE, struct.pack("!H", 1000))
        self.sock.close()

    def _frame(self) -> tuple[bool, int, bytes]:
        """The next whole frame; the buffer is consumed only once the frame is complete in it."""
        while True:
            frame = _parse_frame(self.buffer)
            if frame is not None:
                used, final, opcode, payload = frame
                self.buffer = self.buffer[used:]
                return final, opcode, payload
            self._fill()

    def _send(self, opcode: int, payload: bytes) -> None:
        """A client frame: always masked (RFC 6455 5.3); only control frames here, so under 126 bytes."""
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + masked)

    def _read_until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            if len(self.buffer) > 65536:
                raise ProtocolError("no end of the handshake's headers")
            self._fill()
        head, _, self.buffer = self.buffer.partition(marker)
        return head

    def _fill(self) -> None:
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            raise Silence() from None
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buffer += chunk


def accept_key(key: str) -> str:
    """The server's Sec-WebSocket-Accept for the client's Sec-WebSocket-Key."""
    return base64.b64encode(hashlib.sha1(key.encode() + _GUID).digest()).decode()


def _parse_frame(data: bytes) -> tuple[int, bool, int, bytes] | None:
    """(bytes used, FIN, opcode, unmasked payload) of the frame at the start of `data`; None if incomplete."""
    if len(data) < 2:
        return None
    first, second = data[0], data[1]
    length, at = second & 0x7F, 2
    if length in (126, 127):
        size = 2 if length == 126 else 8
        if len(data) < at + size:
            return None
        length = int.from_bytes(data[at : at + size], "big")
        at += size
    if length > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"a frame of {length} bytes")
    mask = b""
    if second & 0x80:
        if len(data) < at + 4:
            return None
        mask, at = data[at : at + 4], at + 4
    if len(data) < at + length:
        return None
    payload = data[at : at + length]
    if mask:
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return at + length, bool(first & 0x80), first & 0x0F, payload
