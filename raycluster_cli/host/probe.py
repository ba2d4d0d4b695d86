"""Runs inside the head's container: wait until the expected node IPs are alive Ray nodes, print JSON.

`raycluster up` and `status` call `docker exec <head> python -m raycluster_cli.host.probe --expect IP,...`.
It asks the GCS's node table with a plain GCS client, as `ray status` does: no `ray.init`, so no driver is
registered, no core worker starts and the head's raylet starts no worker processes for it (a first driver makes
it start one per CPU, seconds of CPU while `up`'s workers are joining on the same cores). A Ray without that
client falls back to `ray.init` and `ray.nodes()`. Its stdout carries nothing but its one JSON document:
whatever Ray prints (its Python loggers and its C++ core worker write to fd 1 too) goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

GCS_CALL_S = 10  # one node-table read; the caller's deadline is the remote command's own
# Ray's GCS client retries a connect for about 40 s when nothing listens at the address; a plain TCP connect
# first says within this many seconds that the GCS is not there (its port refuses, or nothing answers).
GCS_CONNECT_S = 5.0
Node = dict[str, Any]


class GcsAbsent(Exception):
    """Nothing accepts connections at the GCS's address (its message is the whole error, no type name)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raycluster_cli.host.probe")
    parser.add_argument("--address", default="auto", help="the head's GCS address, HOST:PORT")
    parser.add_argument("--expect", default="", help="comma-separated node IPs to wait for")
    parser.add_argument("--timeout", type=float, default=0.0, help="seconds to wait for them")
    parser.add_argument(
        "--stale-ids", default="", help="comma-separated node IDs whose containers were replaced: wait until dead"
    )
    args = parser.parse_args(argv)
    document = _own_stdout()
    expected = {ip for ip in args.expect.split(",") if ip}
    stale = {node_id for node_id in args.stale_ids.split(",") if node_id}

    try:  # the GCS cannot be reached, or stopped answering while waited on: one error document
        nodes_now = _node_table(args.address)
        deadline = time.monotonic() + args.timeout
        while True:
            nodes = nodes_now()
            live = [n for n in nodes if n["alive"]]
            fresh_ips = [n["node_ip"] for n in live if n["node_id"] not in stale]
            alive = set(fresh_ips)
            # A node whose container was killed stays "alive" in the GCS until its health checks fail. The
            # cluster is settled when every expected IP has a fresh live node, each IP only one, and every
            # replaced node is dead, so that no work can be scheduled on a ghost.
            one_each = len(fresh_ips) == len(alive)
            settled = expected <= alive and one_each and not any(n["node_id"] in stale for n in live)
            if settled or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
    except Exception as exc:
        said = str(exc) if isinstance(exc, GcsAbsent) else f"{type(exc).__name__}: {exc}"
        _say(document, {"ok": False, "error": said.splitlines()[0]})
        return 1
    _say(document, {"ok": settled, "nodes": nodes})
    return 0 if settled else 1


def _node_table(address: str) -> Callable[[], list[Node]]:
    """A function that reads the GCS's node table, connected once (raises if the GCS cannot be reached)."""
    _accepts(address, GCS_CONNECT_S)
    import ray

    try:
        from ray._private.services import canonicalize_bootstrap_address_or_die
        from ray._raylet import GcsClient  # type: ignore[attr-defined]

        client = GcsClient(address=canonicalize_bootstrap_address_or_die(address))
        client.get_all_node_info  # noqa: B018 - a Ray whose client lacks it takes the driver's way
    except (ImportError, AttributeError, TypeError):
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        return lambda: [_from_driver(n) for n in ray.nodes()]

    def read() -> list[Node]:
        table = client.get_all_node_info(timeout=GCS_CALL_S)
        return [_from_gcs(node_id.hex(), info) for node_id, info in table.items()]

    read()  # the first call proves the GCS answers (and authenticates this client), as ray.init did
    return read


def _accepts(address: str, within: float) -> None:
    """Return once a TCP connect to `address` (HOST:PORT; "auto" is not checked) succeeds; raise a
    GcsAbsent that names the address if none does within `within` seconds (tried every 0.2 s)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return
    end = time.monotonic() + within
    while True:
        left = end - time.monotonic()
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=max(0.1, min(2.0, left))).close()
            return
        except OSError as exc:
            if time.monotonic() + 0.2 >= end:
                why = exc.strerror or type(exc).__name__
                raise GcsAbsent(
                    f"the head's GCS at {address} does not accept connections ({why}, for {within:g}s): "
                    "its gcs_server is not running, or the port is closed on the head"
                ) from None
            time.sleep(0.2)


def _from_gcs(node_id: str, info: Any) -> Node:
    return {
        "node_ip": info.node_manager_address,
        "node_id": node_id,
        "hostname": info.node_manager_hostname,
        "alive": info.state == 0,  # GcsNodeInfo.ALIVE
        "resources": _resources(dict(info.resources_total)),
    }


def _from_driver(n: dict[str, Any]) -> Node:
    return {
        "node_ip": n["NodeManagerAddress"],
        "node_id": n["NodeID"],
        "hostname": n.get("NodeManagerHostname", ""),
        "alive": bool(n.get("Alive")),
        "resources": _resources(n.get("Resources", {})),
    }


def _resources(resources: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in resources.items() if not k.startswith("node:")}


def _own_stdout() -> int:
    """A copy of fd 1 for the document; fd 1 itself (and sys.stdout) then point at stderr, for Ray's output."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    return saved


def _say(fd: int, document: dict[str, object]) -> None:
    os.write(fd, (json.dumps(document) + "\n").encode())


if __name__ == "__main__":
    sys.exit(main())
