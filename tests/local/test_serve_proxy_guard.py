"""Ray Serve's own HTTP proxy with the guard `up` puts in every node (serve/proxy_guard.py, through Ray Serve's proxy
callback), on a throwaway local Ray: a connection that never finishes its request head is closed, connections are
capped, a body over the cap is answered 413 before the application reads it, and a client's opt-out of the
disconnect watch never reaches the application.

No ``from __future__ import annotations``: FastAPI reads the route's annotations at runtime.
"""

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

serve = pytest.importorskip("ray.serve")
fastapi = pytest.importorskip("fastapi")

from raycluster_cli.host.containers import SERVE_ENV  # noqa: E402

from ..local_ray import local_serve  # noqa: E402

HEAD_S = 2.0
MAX_BODY = 64 * 1024
MAX_CONNECTIONS = 6


def _app() -> Any:
    """A small application behind the proxy: it says what body and headers reached it."""
    from fastapi import FastAPI, Request

    api = FastAPI()

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    @serve.ingress(api)
    class Echo:
        @api.post("/echo")
        async def echo(self, request: Request) -> dict[str, Any]:
            body = await request.body()
            return {"bytes": len(body), "opt_out": request.headers.get("x-request-disconnect-disabled")}

        @api.get("/ping")
        async def ping(self) -> dict[str, str]:
            return {"ok": "yes"}

        @api.get("/raycluster/status")
        async def status(self, request: Request) -> dict[str, Any]:  # what `status` reads: who asked, with what
            return {"replicas": 1, "pipelines": [], "events": [{"key": request.headers.get("authorization")}]}

    return Echo.bind()


@pytest.fixture(scope="module")
def root() -> Iterator[tuple[str, int]]:
    env = SERVE_ENV | {
        "RAYCLUSTER_PROXY_HEAD_TIMEOUT_S": str(HEAD_S),
        "RAYCLUSTER_PROXY_MAX_BODY_BYTES": str(MAX_BODY),
        "RAYCLUSTER_PROXY_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
    }
    with local_serve(_app(), env) as url:
        host, port = url.removeprefix("http://").split(":")
        deadline = time.monotonic() + 60
        while _exchange((host, int(port)), b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")[0] != 200:
            assert time.monotonic() < deadline, "the service did not answer"
            time.sleep(0.2)
        yield host, int(port)


def _exchange(address: tuple[str, int], raw: bytes, timeout: float = 20.0) -> tuple[int, bytes]:
    """Send ``raw`` on a new connection; the answer's status and body (0 when the server closed without one)."""
    with socket.create_connection(address, timeout=timeout) as sock:
        with contextlib.suppress(OSError):  # the server may answer (and close) before it read a refused body
            sock.sendall(raw)
        data = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                data += chunk
                if b"\r\n\r\n" in data:
                    head, _, rest = data.partition(b"\r\n\r\n")
                    length = next(
                        (
                            int(line.split(b":")[1])
                            for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-length:")
                        ),
                        None,
                    )
                    if length is not None and len(rest) >= length:
                        break
    if not data.startswith(b"HTTP/1.1 "):
        return 0, data
    return int(data.split(b" ")[1]), data.partition(b"\r\n\r\n")[2]


def _post(body: bytes, extra: str = "") -> bytes:
    return (
        f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def test_a_request_head_that_never_ends_is_closed_after_its_deadline(root: tuple[str, int]) -> None:
    began = time.monotonic()
    with socket.create_connection(root, timeout=30) as sock:
        sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n")  # no blank line: the head never ends
        for _ in range(4):  # trickled, as slowloris does, one header every half second
            time.sleep(0.5)
            try:
                sock.sendall(b"X-Slow: 1\r\n")
            except OSError:
                break
        try:
            answer = sock.recv(1024)
        except ConnectionResetError:  # closed while the last trickled header was unread: the kernel resets
            answer = b""
        assert answer == b""  # closed by the server, with no answer
    assert time.monotonic() - began < HEAD_S + 5
    assert _exchange(root, b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200  # whole heads are served


def test_a_body_over_the_cap_is_refused_before_the_application_reads_it(root: tuple[str, int]) -> None:
    status, body = _exchange(root, _post(b"x" * 1000))
    assert status == 200 and json.loads(body) == {"bytes": 1000, "opt_out": None}
    # a Content-Length over the cap: 413 at once, without the body ever being sent
    head = f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {10 * MAX_BODY}\r\n\r\n".encode()
    status, body = _exchange(root, head)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    # a chunked body without a length, over the cap as it arrives
    chunk = b"x" * 16384
    chunked = b"".join(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" for _ in range(8)) + b"0\r\n\r\n"
    raw = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
    assert _exchange(root, raw)[0] == 413


def test_a_client_cannot_opt_out_of_the_disconnect_watch_nor_list_the_routes(root: tuple[str, int]) -> None:
    status, body = _exchange(root, _post(b"{}", "x-request-disconnect-disabled: ?1\r\n"))
    assert status == 200 and json.loads(body) == {"bytes": 2, "opt_out": None}
    assert _exchange(root, b"GET /-/routes HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 404  # Serve answers 200 unguarded


def test_connections_past_the_cap_are_refused_until_the_held_ones_end(root: tuple[str, int]) -> None:
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):
            sock = socket.create_connection(root, timeout=30)
            sock.sendall(b"GET /ping HTTP/1.1\r\n")  # held open with an unfinished head
            held.append(sock)
        time.sleep(0.3)
        assert _exchange(root, b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 503
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + HEAD_S + 10
    while _exchange(root, b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")[0] != 200:
        assert time.monotonic() < deadline, "the cap did not free up once the held connections ended"
        time.sleep(0.2)
