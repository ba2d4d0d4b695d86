"""The operator's HTTP calls to the service `serve` deployed, on httpx2 (``bench --serve``'s requests and streams).

httpx2 speaks the protocol (HTTP/1.1 through h11, which also bounds the head and each chunk's size line to
100 KiB) and verifies TLS with the caller's ``ssl.SSLContext`` (the system's CAs by default). What this module
adds is what a benchmark holding dozens of streams on one event loop needs from every request:

* one deadline over the whole exchange, body included: httpx2's timeouts bound each connect and each read, so a
  server sending a byte now and then would hold a stream forever without it; the request ends with
  ``TimeoutError`` when its deadline passes, never a hang;
* a cap on the body: a server that sends without end fills no memory, the request ends with ``HTTPFailure``
  naming the URL and the cap;
* one exception for the server being unreachable or answering something that is not HTTP (``HTTPFailure``, the
  URL in its one line).

Each request has its own connection (no pool: a saturation run's requests never wait on each other for one), and
no proxy or netrc from the environment: the benchmark measures the service, not a proxy in front of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import ssl
from collections.abc import AsyncIterator
from typing import Any

import httpx2

MAX_BODY_BYTES = 64 * 1024 * 1024  # a response body, unless the caller gives its own cap
CONNECT_S = 30.0  # the longest wait for a connection (and its TLS handshake), within the request's deadline


class HTTPFailure(Exception):
    """The server could not be reached, or answered with something that is not HTTP."""


class Response:
    """Status, headers (names in lower case), and the body read as it arrives, under its cap."""

    def __init__(self, answer: httpx2.Response, url: str, max_body_bytes: int) -> None:
        self.status = answer.status_code
        self.headers = {name.lower(): value for name, value in answer.headers.items()}
        self.url = url
        self.max_body_bytes = max_body_bytes
        self._answer = answer

    def _over(self) -> HTTPFailure:
        return HTTPFailure(f"{self.url}: the response body passed its cap of {self.max_body_bytes} bytes")

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes, piece by piece as the server sends them (decoded, counted against the cap)."""
        announced = self.headers.get("content-length", "")
        if announced.isascii() and announced.isdigit() and int(announced) > self.max_body_bytes:
            raise self._over()  # refused before its bytes are read
        received = 0
        async for data in self._answer.aiter_bytes():
            received += len(data)
            if received > self.max_body_bytes:
                raise self._over()
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


@functools.cache
def _system_context() -> ssl.SSLContext:
    """The system's CAs, made once (a context per request would read them per request)."""
    return ssl.create_default_context()


def _tls_failure(exc: BaseException | None) -> bool:
    """Whether the connection failed in its TLS handshake (httpx2 keeps the ``ssl.SSLError`` as a cause)."""
    while exc is not None:
        if isinstance(exc, ssl.SSLError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


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
    ``timeout_s`` bounds the whole exchange, body included (and each read; the connect at most ``CONNECT_S``);
    ``max_body_bytes`` the body's size. Raises ``TimeoutError``, ``HTTPFailure``, or ``ValueError`` for a URL
    that is not http:// or https://."""
    timeout = httpx2.Timeout(timeout_s, connect=min(timeout_s, CONNECT_S))
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=0)
    try:
        async with (
            asyncio.timeout(timeout_s),
            httpx2.AsyncClient(verify=tls or _system_context(), timeout=timeout, limits=limits, trust_env=False) as c,
            c.stream(method, url, json=json_body, headers=headers) as answer,
        ):
            yield Response(answer, url, max_body_bytes)
    except (httpx2.UnsupportedProtocol, httpx2.InvalidURL) as exc:
        raise ValueError(f"{url!r} is not an http:// or https:// URL ({exc})") from None
    except (httpx2.TimeoutException, TimeoutError):
        raise TimeoutError(f"{url}: the request passed its deadline of {timeout_s:g} s") from None
    except httpx2.ConnectError as exc:
        if _tls_failure(exc):
            raise HTTPFailure(f"{url}: TLS failed: {exc}") from None
        raise HTTPFailure(f"{url}: could not connect: {exc}") from None
    except httpx2.HTTPError as exc:
        raise HTTPFailure(f"{url}: {type(exc).__name__}: {exc}") from None
