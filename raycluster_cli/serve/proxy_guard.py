"""Ray Serve's HTTP proxy, hardened for a port any neighbour can reach: request heads under a deadline,
connections capped, bodies capped before any key is looked at, and no client opting out of the disconnect watch.

Ray Serve runs the proxy (uvicorn) itself and offers one hook into it: the function
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` names is called in the proxy's process before its server starts, and
returns ASGI middlewares (``up`` sets it in every node's container: host/containers.SERVE_ENV). Out of the box the
proxy holds a connection that never finishes its request head for ever (slowloris: one socket and a little memory
each, without end), buffers a queued request's body whatever its size while no key has been checked yet, and
honours ``x-request-disconnect-disabled``, which lets a client's generation outlive its connection. So ``guard``:

- gives every request head ``HEAD_TIMEOUT_S`` from the connection's start (or its previous answer's end) to
  arrive whole, else closes the connection (uvicorn's own keep-alive timer covers only idle connections);
- caps the server's connections and tasks (uvicorn's ``limit_concurrency``: past it, new requests get 503);
- answers 413 to a body longer than ``MAX_BODY_BYTES`` (by its Content-Length at once, else as it arrives), before
  the ingress, which checks keys, ever sees it;
- drops ``x-request-disconnect-disabled`` from every request;
- puts ``Retry-After`` on a 503 that has none (Serve's own, when the queue for the ingress is full);
- answers 503 with ``Retry-After`` when the proxy sent nothing for a request: its ingress replica died before the
  answer began (Ray Serve then leaves uvicorn's bare 500, which says neither what happened nor that a retry will do;
  Serve starts a new replica, tests/local/test_serve_process_deaths.py);
- answers 404 to ``/-/routes`` (Ray Serve's list of the applications it routes to, open to anyone otherwise).

Each bound is an environment variable of the node's container (the inventory's ``env`` may change it).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

log = logging.getLogger(__name__)
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DISCONNECT_DISABLED = b"x-request-disconnect-disabled"
RETRY_AFTER_S = b"2"  # on a 503 that gives none (Ray Serve's answer when the ingress's queue is full)


def _env_number(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        return default
    return value if value > 0 else default


def head_timeout_s() -> float:
    return _env_number("RAYCLUSTER_PROXY_HEAD_TIMEOUT_S", 10.0)


def max_connections() -> int:
    return int(_env_number("RAYCLUSTER_PROXY_MAX_CONNECTIONS", 1024))


def max_body_bytes() -> int:
    return int(_env_number("RAYCLUSTER_PROXY_MAX_BODY_BYTES", 8 * 1024 * 1024))


class BodyCap:
    """ASGI middleware: the disconnect opt-out header dropped; Serve's route list hidden; a body over ``limit`` bytes
    answered 413 (the app behind sees its client leave); a 503 told when to retry."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("path") == "/-/routes":
            await _answer(send, 404, "not_found", "no such route")
            return
        scope["headers"] = [(k, v) for k, v in scope.get("headers", []) if k.lower() != DISCONNECT_DISABLED]
        length = next((v for k, v in scope["headers"] if k.lower() == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._refuse(send)
            return
        received, refused, started = 0, False, False

        async def capped() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message.get("type") == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    refused = True
                    await self._refuse(send)
                    return {"type": "http.disconnect"}
            return message

        async def unless_refused(message: Message) -> None:
            nonlocal started
            if refused:
                return
            started = started or message.get("type") == "http.response.start"
            if message.get("type") == "http.response.start" and message.get("status") == 503:
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"retry-after" for k, _ in headers):  # Serve's full queue says none
                    message = {**message, "headers": [*headers, (b"retry-after", RETRY_AFTER_S)]}
            await send(message)

        try:
            await self.app(scope, capped, unless_refused)
        except Exception:
            if started or refused:
                raise
            log.warning("the proxy failed a request before its answer began", exc_info=True)
        if not (started or refused):  # the ingress died under it (or its client left: then nobody reads this)
            why = "the service's ingress stopped before answering; it is restarting: retry"
            await _answer(send, 503, "service_unavailable", why, retry_after=True)

    async def _refuse(self, send: Send) -> None:
        await _answer(send, 413, "request_too_large", f"the request's body is over {self.limit} bytes")


async def _answer(send: Send, status: int, code: str, message: str, *, retry_after: bool = False) -> None:
    """An error in OpenAI's shape, the connection closed after it; ``retry_after``: a 503 that says when to retry."""
    kind = "service_unavailable" if status == 503 else "invalid_request_error"
    error = {"message": message, "type": kind, "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *([(b"retry-after", RETRY_AFTER_S)] if retry_after else []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _arm(protocol: Any) -> None:
    """(Re)start the protocol's head deadline: the connection is closed unless a whole head arrives first."""
    _disarm(protocol)
    protocol._raycluster_head_timer = protocol.loop.call_later(head_timeout_s(), _expire, protocol)


def _disarm(protocol: Any) -> None:
    timer = getattr(protocol, "_raycluster_head_timer", None)
    if timer is not None:
        timer.cancel()
        protocol._raycluster_head_timer = None


def _expire(protocol: Any) -> None:
    protocol._raycluster_head_timer = None
    transport = getattr(protocol, "transport", None)
    if transport is not None and not transport.is_closing():
        transport.close()


def _wrap(cls: type, name: str, before: Callable[[Any], None] | None, after: Callable[[Any], None] | None) -> None:
    original = getattr(cls, name)

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(self)
        result = original(self, *args, **kwargs)
        if after is not None:
            after(self)
        return result

    wrapped.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(cls, name, wrapped)


def _head_done_h11(protocol: Any) -> None:
    import h11

    if protocol.conn.their_state in (h11.SEND_BODY, h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
        _disarm(protocol)


def patch_uvicorn() -> None:
    """Head deadlines in uvicorn's two HTTP protocols, and a connection cap in its config (once per process)."""
    import uvicorn
    from uvicorn.protocols.http import h11_impl

    if getattr(uvicorn.Config, "_raycluster_guarded", False):
        return
    limit = max_connections()
    _wrap_config(uvicorn.Config, limit)
    _wrap(h11_impl.H11Protocol, "connection_made", None, _arm)
    _wrap(h11_impl.H11Protocol, "handle_events", None, _head_done_h11)
    _wrap(h11_impl.H11Protocol, "on_response_complete", None, _arm)
    _wrap(h11_impl.H11Protocol, "connection_lost", _disarm, None)
    try:
        from uvicorn.protocols.http import httptools_impl
    except ImportError:  # no httptools: uvicorn runs h11
        return
    _wrap(httptools_impl.HttpToolsProtocol, "connection_made", None, _arm)
    _wrap(httptools_impl.HttpToolsProtocol, "on_message_begin", None, _arm)
    _wrap(httptools_impl.HttpToolsProtocol, "on_headers_complete", _disarm, None)
    _wrap(httptools_impl.HttpToolsProtocol, "connection_lost", _disarm, None)


def _wrap_config(config: Any, limit: int) -> None:
    original = config.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("limit_concurrency", limit)
        if kwargs["limit_concurrency"] is None:
            kwargs["limit_concurrency"] = limit
        original(self, *args, **kwargs)

    config.__init__ = init
    config._raycluster_guarded = True


def guard() -> list[Any]:
    """The proxy's callback (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``): patch uvicorn, return the middleware."""
    from starlette.middleware import Middleware

    patch_uvicorn()
    log.info(
        "raycluster proxy guard: heads within %.0f s, %d connections, bodies up to %d bytes",
        head_timeout_s(),
        max_connections(),
        max_body_bytes(),
    )
    return [Middleware(BodyCap, limit=max_body_bytes())]
