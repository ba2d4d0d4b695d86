"""The service's TLS pair on loopback: a self-signed pair made for the head is what the clients raycluster ships
verify the service with (a real TLS handshake against a real HTTPS server)."""

from __future__ import annotations

import asyncio
import os
import ssl
import threading
import time
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


def test_ray_serves_proxy_serves_https_with_the_pair_and_our_client_verifies_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher's HTTP options for `--tls-cert/--tls-key` (a pair made for the head, here 127.0.0.1) given to Ray
    Serve's own proxy: it serves HTTPS, our client reaches it verifying the certificate, refuses it without, and a
    plain http:// request gets no answer from the TLS port."""
    pytest.importorskip("ray.serve")
    from raycluster_cli.serve.__main__ import http_options
    from raycluster_cli.serve.options import LaunchOptions

    from ..local_ray import local_serve
    from .test_serve_proxy_guard import _app

    monkeypatch.setenv("RAYCLUSTER_STATE_DIR", str(tmp_path / "state"))
    files = serve_keys.self_signed(inventory.parse(INVENTORY, "inv.yaml"))
    given = LaunchOptions(model_path="/m", host="127.0.0.1", tls_cert=str(files.cert), tls_key=str(files.key))
    tls = {k: v for k, v in http_options(given).items() if k.startswith("ssl_")}
    assert tls == {"ssl_certfile": str(files.cert), "ssl_keyfile": str(files.key)}

    async def ping(url: str, context: ssl.SSLContext | None) -> Any:
        async with http.request("GET", f"{url}/ping", timeout_s=10, tls=context) as answer:
            return answer.status, await answer.json()

    with local_serve(_app(), http=tls) as root:
        assert root.startswith("https://")
        deadline = time.monotonic() + 60
        while True:
            try:
                assert asyncio.run(ping(root, serve_keys.client_context(files.cert))) == (200, {"ok": "yes"})
                break
            except (http.HTTPFailure, OSError, TimeoutError):
                assert time.monotonic() < deadline, "the HTTPS service did not answer"
        with pytest.raises(http.HTTPFailure, match="TLS failed"):
            asyncio.run(ping(root, None))
        live = _status_script(tmp_path, f"{root}/v1", files.cert.read_text())
        assert live.get("live", {}).get("events") == [{"key": "Bearer the-service-key"}], live
        unverified = _status_script(tmp_path, f"{root}/v1", None)  # no certificate: refused, not trusted blindly
        assert "live" not in unverified and "CERTIFICATE_VERIFY_FAILED" in unverified["live_error"], unverified
        with pytest.raises((http.HTTPFailure, TimeoutError)):
            asyncio.run(ping(root.replace("https://", "http://"), None))


def _status_script(tmp_path: Path, service_url: str, cert: str | None) -> dict[str, Any]:
    """The script `status` runs in the head's container (verbs/serve._STATUS) with the service's key and certificate
    on stdin, against Ray's dashboard (a loopback stand-in saying the application runs) and the HTTPS service."""
    import http.server
    import json
    import subprocess
    import sys

    from raycluster_cli.verbs import serve as serve_verb

    class Dashboard(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = json.dumps({"applications": {"raycluster": {"status": "RUNNING"}}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Dashboard)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    record = tmp_path / "record.json"
    record.write_text(json.dumps({"model": "m", "url": service_url}))
    script = serve_verb._STATUS % {
        "record": str(record),
        "url": f"http://127.0.0.1:{server.server_address[1]}/api/serve/applications/",
        "token": str(tmp_path / "no-token"),
        "app": "raycluster",
    }
    try:
        done = subprocess.run(
            [sys.executable, "-c", script],
            input=json.dumps({"key": "the-service-key", "cert": cert}),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
    finally:
        server.shutdown()
    document: dict[str, Any] = json.loads(done.stdout)
    return document
