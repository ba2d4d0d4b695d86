"""An HTTP/1.1 client on asyncio streams, for the operator's calls to the service `serve` deployed.

The operator install has no HTTP library beyond the standard library, and ``http.client`` blocks a thread per
response; the serving benchmark holds dozens of streamed answers at once and times each of their events, so it
reads them all on one event loop. One request per connection (``Connection: close``), ``http://`` or ``https://``
(verified with the caller's ``ssl.SSLContext``, the system's CAs by default), and every wait (connect, each read)
under the request's one deadline: a server that stops sending mid-stream ends the request with ``TimeoutError``
when its deadline passes, never a hang. And every size is capped (the head, its header count, a chunk's size line,
the body): a server that sends without end fills no memory, the request ends with ``HTTPFailure`` naming the URL
and the cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")
MAX_HEAD_BYTES = 64 * 1024  # the status line and headers; also the longest line the reader buffers
MAX_HEADERS = 100
MAX_BODY_BYTES = 64 * 1024 * 1024  # a response body, unless the caller gives its own cap
MAX_CHUNK_LINE = 1024  # a chunk's size line with its extensions
PIECE = 65536  # the largest piece read at once (a large chunk is read in pieces)


class HTTPFailure(Exception):
    """The server could not be reached, or answered with something that is not HTTP."""


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    path: str
    tls: bool = False


def parse_url(url: str) -> Target:
    """Host, port and path of an ``http://`` or ``https://`` URL (ValueError for anything else)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http:// or https:// URL")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    tls = parts.scheme == "https"
    return Target(parts.hostname, parts.port or (443 if tls else 80), path, tls)


class Response:
    """Status, headers, and the body read as it arrives (chunked, by length, or until the server closes)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        status: int,
        headers: dict[str, str],
        deadline: float,
        url: str = "",
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.status = status
        self.headers = headers
        self.url = url
        self.max_body_bytes = max_body_bytes
        self._reader = reader
        self._deadline = deadline
        self._received = 0

    async def _wait(self, work: Awaitable[T]) -> T:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's deadline passed")
        return await asyncio.wait_for(work, left)

    def _count(self, size: int) -> None:
        """Refuse the body once it would pass its cap (before those bytes are read when the size is announced)."""
        self._received += size
        if self._received > self.max_body_bytes:
            raise HTTPFailure(f"{self.url}: the response body passed its cap of {self.max_body_bytes} bytes")

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes, piece by piece as the server sends them."""
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while size := await self._chunk_size():
                self._count(size)
                left = size
                while left > 0:
                    data = await self._wait(self._reader.read(min(left, PIECE)))
                    if not data:
                        raise HTTPFailure(f"{self.url}: the server closed in the middle of a chunk")
                    left -= len(data)
                    yield data
                if await self._wait(self._reader.readexactly(2)) != b"\r\n":
                    raise HTTPFailure(f"{self.url}: a chunk does not end with CRLF")
        elif "content-length" in self.headers:
            left = self._length()
            self._count(left)
            while left > 0:
                data = await self._wait(self._reader.read(min(left, PIECE)))
                if not data:
                    raise HTTPFailure(f"{self.url}: the server closed with {left} byte(s) of the body unsent")
                left -= len(data)
                yield data
        else:
            while data := await self._wait(self._reader.read(PIECE)):
                self._count(len(data))
                yield data

    async def _chunk_size(self) -> int:
        """The next chunk's size from its size line (at most MAX_CHUNK_LINE bytes, hexadecimal digits)."""
        try:
            line = await self._wait(self._reader.readuntil(b"\n"))
        except asyncio.LimitOverrunError:
            raise HTTPFailure(f"{self.url}: a chunk size line longer than {MAX_CHUNK_LINE} bytes") from None
        if len(line) > MAX_CHUNK_LINE:
            raise HTTPFailure(f"{self.url}: a chunk size line longer than {MAX_CHUNK_LINE} bytes")
        digits = line.split(b";")[0].strip()
        if not digits or len(digits) > 16 or digits.strip(b"0123456789abcdefABCDEF"):
            raise HTTPFailure(f"{self.url}: a bad chunk size line: {line[:40]!r}")
        return int(digits, 16)

    def _length(self) -> int:
        text = self.headers["content-length"]
        if not text.isascii() or not text.isdigit():
            raise HTTPFailure(f"{self.url}: a bad Content-Length: {text[:40]!r}")
        return int(text)

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines (without their ends), each as soon as it is complete."""
        pending = b""
        async for data in self.chunks():
            pending += data
            *complete, pending = pending.split(b"\n")
            for line in complete:
                yield line.rstrip(b"\r").decode("utf-8", "replace")
        if pending:
            yield pending.decode("utf-8", "replace")

    async def read(self) -> bytes:
        return b"".join([data async for data in self.chunks()])

    async def json(self) -> Any:
        body = await self.read()
        try:
            return json.loads(body)
        except ValueError:
            raise HTTPFailure(f"HTTP {self.status}: the body is not JSON: {body[:120]!r}") from None


def _head(method: str, target: Target, headers: dict[str, str], body: bytes) -> bytes:
    lines = [f"{method} {target.path} HTTP/1.1", f"Host: {target.host}:{target.port}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if body or method in {"POST", "PUT"}:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _parse_head(raw: bytes, url: str = "") -> tuple[int, dict[str, str]]:
    status_line, *header_lines = raw.decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise HTTPFailure(f"{url}: not an HTTP answer: {status_line[:80]!r}")
    if len(header_lines) > MAX_HEADERS:
        raise HTTPFailure(f"{url}: the response has {len(header_lines)} header lines, more than {MAX_HEADERS}")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


@contextlib.asynccontextmanager
async def request(
    method: str,
    url: str,
    *,
    timeout_s: float,
    json_body: Any = None,
    headers: dict[str, str] | None = None,
    tls: ssl.SSLContext | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> AsyncIterator[Response]:
    """Send one request; yield its response once the status and headers are in (the body is read through it).
    ``timeout_s`` bounds the whole exchange, body included; ``max_body_bytes`` the body's size (a caller that
    expects more says so). Raises ``TimeoutError`` or ``HTTPFailure``."""
    deadline = time.monotonic() + timeout_s
    target = parse_url(url)
    body = b"" if json_body is None else json.dumps(json_body).encode()
    sent = dict(headers or {}) | ({"Content-Type": "application/json"} if json_body is not None else {})
    context = (tls or ssl.create_default_context()) if target.tls else None
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(target.host, target.port, limit=MAX_HEAD_BYTES, ssl=context), timeout_s
        )
    except ssl.SSLError as exc:
        raise HTTPFailure(f"{target.host}:{target.port}: TLS failed: {exc}") from None
    except OSError as exc:
        raise HTTPFailure(f"could not connect to {target.host}:{target.port}: {exc}") from None
    try:
        writer.write(_head(method, target, sent, body) + body)
        await asyncio.wait_for(writer.drain(), max(0.0, deadline - time.monotonic()))
        try:
            raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), max(0.0, deadline - time.monotonic()))
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise HTTPFailure(
                f"{url}: the server closed or sent no HTTP head within {MAX_HEAD_BYTES} bytes: {exc}"
            ) from None
        status, response_headers = _parse_head(raw[:-4], url)
        yield Response(reader, status, response_headers, deadline, url, max_body_bytes)
    except (ConnectionError, asyncio.IncompleteReadError) as exc:
        raise HTTPFailure(f"{url}: the connection broke: {exc}") from None
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), 1.0)
