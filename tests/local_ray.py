"""A throwaway single-node local Ray for tests (no auth, no dashboard), as a context manager."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from raycluster_cli.apikeys import KeyEntry, render_keys


def write_keys(path: Path, keys: Mapping[str, str], limits: Mapping[str, Mapping[str, int]] | None = None) -> str:
    """A keys document at ``path`` for the service (``name: key``; ``limits``: a key's max_requests/max_tokens),
    written whole (as the operator's `docker exec` does: a new file moved into place); returns its path."""
    entries = [KeyEntry.make(name, key, **dict((limits or {}).get(name, {}))) for name, key in keys.items()]
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(render_keys(entries))
    temp.replace(path)
    return str(path)


@contextlib.contextmanager
def one_node_ray(**options: Any) -> Iterator[str]:
    """Start a local Ray of one node (``options`` go to ``ray.init`` over the defaults) and yield its node id."""
    import ray

    settings: dict[str, Any] = {
        "address": "local",
        "num_cpus": 2,
        "include_dashboard": False,
        "log_to_driver": False,
        "configure_logging": False,
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        ray.init(**(settings | options))
        try:
            yield ray.get_runtime_context().get_node_id()
        finally:
            ray.shutdown()


@contextlib.contextmanager
def local_serve(
    app: Any, env: Mapping[str, str] | None = None, http: Mapping[str, Any] | None = None, **options: Any
) -> Iterator[str]:
    """A throwaway local Ray with Ray Serve on a free loopback port running ``app`` (``env`` set while it runs, as
    `up` sets the nodes' containers; ``http`` more of Serve's HTTP options, a TLS pair say; ``options`` go to
    ``ray.init`` over the defaults): yields the service's root URL; everything is shut down after."""
    import ray
    from ray import serve

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        for name, value in (env or {}).items():
            mp.setenv(name, value)
        defaults = {
            "address": "local",  # a Ray of its own, never one another process on this machine started
            "num_cpus": 2,
            "include_dashboard": False,
            "log_to_driver": False,
            "configure_logging": False,
        }
        ray.init(**(defaults | {"_node_ip_address": "127.0.0.1"} | options))
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port} | dict(http or {}))
            serve.run(app, name="raycluster", route_prefix="/")
            scheme = "https" if (http or {}).get("ssl_certfile") else "http"
            yield f"{scheme}://127.0.0.1:{port}"
        finally:
            serve.shutdown()
            ray.shutdown()
