"""An HTTP/1.1 client on asyncio streams, for the operator's calls to the service `serve` deployed.

The operator install has no HTTP library beyond the standard library, and ``http.client`` blocks a thread per
response; the serving benchmark holds dozens of streamed answers at once and times each of their events, so it
reads them all on one event loop. One request per connection (``Connection: close``), ``http://`` or ``https://``
(verified with the caller's ``ssl.SSLContext``, the system's CAs by default), and every wait (connect, each read) under the request's one deadline: a server that stops sending mid-stream
ends the request with ``TimeoutError`` when its deadline passes, never a hang.
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
MAX_HEAD_BYTES = 64 * 1024


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

    def __init__(self, reader: asyncio.StreamReader, status: int, headers: dict[str, str], deadline: float) -> None:
        self.status = status
        self.headers = headers
        self._reader = reader
        self._deadline = deadline

    async def _wait(self, work: Awaitable[T]) -> T:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's deadline passed")
        return await asyncio.wait_for(work, left)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes, piece by piece as the server sends them."""
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await self._wait(self._reader.readline())
                try:
                    size = int(size_line.split(b";")[0].strip() or b"0", 16)
                except ValueError:
                    raise HTTPFailure(f"a bad chunk size line: {size_line[:40]!r}") from None
                if size == 0:
                    return
                data = await self._wait(self._reader.readexactly(size + 2))
                yield data[:-2]
        elif "content-length" in self.headers:
            left = int(self.headers["content-length"])
            while left > 0:
                data = await self._wait(self._reader.read(min(left, 65536)))
                if not data:
                    raise HTTPFailure(f"the server closed with {left} byte(s) of the body unsent")
                left -= len(data)
                yield data
        else:
            while data := await self._wait(self._reader.read(65536)):
                yield data

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


def _parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    status_line, *header_lines = raw.decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise HTTPFailure(f"not an HTTP answer: {status_line[:80]!r}")
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
) -> AsyncIterator[Response]:
    """Send one request; yield its response once the status and headers are in (the body is read through it).
    ``timeout_s`` bounds the whole exchange, body included. Raises ``TimeoutError`` or ``HTTPFailure``."""
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
            raise HTTPFailure(f"{target.host}:{target.port} closed or sent no HTTP head: {exc}") from None
        status, response_headers = _parse_head(raw[:-4])
        yield Response(reader, status, response_headers, deadline)
    except (ConnectionError, asyncio.IncompleteReadError) as exc:
        raise HTTPFailure(f"{target.host}:{target.port}: the connection broke: {exc}") from None
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), 1.0)
