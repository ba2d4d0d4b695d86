"""transport/http.py (httpx2 under one deadline and a body cap) against a real server on the loopback (asyncio's,
writing raw HTTP): chunked bodies read piece by piece as they arrive, bodies by length, the deadline that ends a
stream the server stops feeding or feeds a byte at a time, and the caps on bodies, chunk size lines and heads."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import pytest

from raycluster_cli.transport import http

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler, client: Callable[[str], Awaitable[object]]) -> object:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        return await client(f"http://127.0.0.1:{port}/v1/completions")
    finally:
        server.close()


async def _head(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0)
    return head + await reader.readexactly(length)


def test_a_chunked_stream_is_read_line_by_line_as_it_arrives() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await _head(reader))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for piece in (b'data: {"a": 1}\n\n', b"data: [DO", b"NE]\n\n"):
            writer.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            await writer.drain()
            await asyncio.sleep(0.2)
        writer.write(b"0\r\n\r\n")
        writer.close()

    async def client(url: str) -> object:
        got: list[tuple[str, float]] = []
        began = time.monotonic()
        async with http.request(
            "POST", url, timeout_s=5, json_body={"x": 1}, headers={"Authorization": "Bearer t"}
        ) as a:
            assert a.status == 200
            async for line in a.lines():
                got.append((line, time.monotonic() - began))
        return got

    got = asyncio.run(_serve(handler, client))
    assert isinstance(got, list)
    assert [line for line, _ in got] == ['data: {"a": 1}', "", "data: [DONE]", ""]
    assert got[2][1] - got[0][1] > 0.35  # the first line came before the server sent the rest
    request = seen[0]
    assert request.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"Authorization: Bearer t" in request and request.endswith(b'{"x":1}')


def test_a_body_by_length_and_an_error_status() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        body = b'{"error": {"message": "full"}}'
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        writer.close()

    async def client(url: str) -> object:
        async with http.request("GET", url, timeout_s=5) as answer:
            return answer.status, await answer.json()

    assert asyncio.run(_serve(handler, client)) == (503, {"error": {"message": "full"}})


def test_a_stream_the_server_stops_feeding_ends_at_the_deadline() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(30)  # then nothing: a wedged server

    async def client(url: str) -> object:
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            async with http.request("GET", url, timeout_s=0.6) as answer:
                await answer.read()
        return time.monotonic() - began

    waited = asyncio.run(_serve(handler, client))
    assert isinstance(waited, float) and 0.5 < waited < 2.0


def test_a_stream_that_trickles_forever_ends_at_the_whole_request_deadline() -> None:
    """A byte every 0.1 s never trips a per-read timeout: only the deadline over the whole request ends it."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
        with contextlib.suppress(ConnectionError, OSError):
            for _ in range(600):
                writer.write(b"x")
                await writer.drain()
                await asyncio.sleep(0.1)

    async def client(url: str) -> object:
        began = time.monotonic()

        async def read() -> None:
            async with http.request("GET", url, timeout_s=1.0) as answer:
                await answer.read()

        with pytest.raises(TimeoutError, match="passed its deadline of 1 s"):
            await asyncio.wait_for(read(), 10)  # without the request's own deadline: this one, and no match
        return time.monotonic() - began

    waited = asyncio.run(_serve(handler, client))
    assert isinstance(waited, float) and 0.9 < waited < 3.0


def test_nothing_listening_and_not_http() -> None:
    async def client(url: str) -> object:
        async with http.request("GET", url, timeout_s=2):
            return None

    with pytest.raises(http.HTTPFailure, match="could not connect"):
        asyncio.run(client("http://127.0.0.1:9/"))
    with pytest.raises(ValueError, match="not an http:// or https:// URL"):
        asyncio.run(client("ftp://example.invalid/v1"))


async def _endless(writer: asyncio.StreamWriter, head: bytes, piece: bytes) -> None:
    """Write `head`, then `piece` again and again until the client hangs up."""
    writer.write(head)
    try:
        while True:
            writer.write(piece)
            await writer.drain()
    except (ConnectionError, OSError):
        pass


def _fails(handler: Handler, max_body_bytes: int = http.MAX_BODY_BYTES) -> tuple[str, float]:
    """Read the whole answer of `handler`'s server: the HTTPFailure's message and how long it took to come."""

    async def client(url: str) -> object:
        began = time.monotonic()
        with pytest.raises(http.HTTPFailure) as failure:
            async with http.request("GET", url, timeout_s=30, max_body_bytes=max_body_bytes) as answer:
                await answer.read()
        assert url in str(failure.value)  # the one line names what was asked
        return str(failure.value), time.monotonic() - began

    found = asyncio.run(_serve(handler, client))
    assert isinstance(found, tuple)
    return found


def test_an_endless_body_ends_at_the_cap_without_filling_memory() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        await _endless(writer, b"HTTP/1.1 200 OK\r\n\r\n", b"x" * 65536)

    message, took = _fails(handler)
    assert f"cap of {http.MAX_BODY_BYTES} bytes" in message and took < 20
    message, took = _fails(handler, max_body_bytes=1 << 20)
    assert "cap of 1048576 bytes" in message and took < 5


def test_an_endless_chunk_and_an_endless_chunk_size_line_end_at_their_caps() -> None:
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def huge_chunk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        await _endless(writer, chunked + b"7fffffffffffffff\r\n", b"x" * 65536)

    async def size_line(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        await _endless(writer, chunked, b"f" * 65536)

    async def small_chunks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        await _endless(writer, chunked, b"10000\r\n" + b"x" * 65536 + b"\r\n")

    message, took = _fails(huge_chunk)
    assert "passed its cap" in message and took < 5  # refused when announced, before its bytes are read
    message, took = _fails(size_line)
    assert "Receive buffer too long" in message and took < 5  # h11's bound on a line it waits the end of
    message, took = _fails(small_chunks, max_body_bytes=1 << 20)
    assert "cap of 1048576 bytes" in message and took < 5


def test_a_length_over_the_cap_and_an_endless_head_are_refused() -> None:
    async def long(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        await _endless(writer, b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n", b"x" * 65536)

    async def headers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _head(reader)
        await _endless(writer, b"HTTP/1.1 200 OK\r\n", b"X-A: b\r\n" * 1000)

    message, took = _fails(long)
    assert "passed its cap" in message and took < 5
    message, took = _fails(headers)
    assert "Receive buffer too long" in message and took < 5  # h11 bounds the head: 100 KiB
