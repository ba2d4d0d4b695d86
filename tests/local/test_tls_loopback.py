"""The service's TLS pair on loopback: a self-signed pair made for the head is what the clients raycluster ships
verify the service with (a real TLS handshake against a real HTTPS server)."""

from __future__ import annotations

import asyncio
import os
import ssl
import threading
from pathlib import Path
from typing import Any

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.errors import UsageError
from raycluster_cli.transport import http
from raycluster_cli.verbs import serve_keys

INVENTORY = """
cluster: demo
image: raycluster/node:0.1.0
hosts:
  - {address: 127.0.0.1, role: head}
"""


def _tls_server(cert: Path, key: Path) -> tuple[int, Any]:
    """A loopback HTTPS server with the pair, answering every GET with a small JSON body."""
    import http.server

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = b'{"ok": true}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert), str(key))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return int(server.server_address[1]), server


def test_a_self_signed_pair_for_the_head_is_what_our_clients_verify_the_service_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pair made for the head's address: our HTTP client reaches an HTTPS server holding it when given the
    certificate, and refuses it without (an unknown certificate); the pair is kept and made again only when the
    head's address changes."""
    monkeypatch.setenv("RAYCLUSTER_STATE_DIR", str(tmp_path / "state"))
    inv = inventory.parse(INVENTORY, "inv.yaml")
    files = serve_keys.self_signed(inv)
    assert os.stat(files.key).st_mode & 0o777 == 0o600
    assert serve_keys.self_signed(inv).cert.read_bytes() == files.cert.read_bytes()  # kept
    port, server = _tls_server(files.cert, files.key)

    async def get(context: ssl.SSLContext | None) -> Any:
        async with http.request("GET", f"https://127.0.0.1:{port}/x", timeout_s=10, tls=context) as answer:
            return await answer.json()

    try:
        assert asyncio.run(get(serve_keys.client_context(files.cert))) == {"ok": True}
        with pytest.raises(http.HTTPFailure, match="TLS failed"):
            asyncio.run(get(None))  # the system's CAs alone do not know it
    finally:
        server.shutdown()
    given = serve_keys.given_pair(inv, str(files.cert), str(files.key))
    assert given.cert.read_bytes() == files.cert.read_bytes()
    with pytest.raises(UsageError, match="--tls-cert"):
        serve_keys.given_pair(inv, str(files.cert), str(files.cert))
