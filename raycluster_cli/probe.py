"""Runs inside the head's container: wait until the expected node IPs are alive Ray nodes, print JSON.

`raycluster up` and `status` call `docker exec <head> python -m raycluster_cli.probe --expect IP,...`.
One `ray.init` per call keeps polling cheap. Its stdout carries nothing but its one JSON document: whatever Ray
prints (its Python loggers and its C++ core worker write to fd 1 too) goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raycluster_cli.probe")
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

    import ray

    try:
        ray.init(address=args.address, logging_level=logging.ERROR, log_to_driver=False)
    except Exception as exc:
        _say(document, {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]})
        return 1
    deadline = time.monotonic() + args.timeout
    while True:
        nodes = ray.nodes()
        live = [n for n in nodes if n.get("Alive")]
        fresh_ips = [n["NodeManagerAddress"] for n in live if n["NodeID"] not in stale]
        alive = set(fresh_ips)
        # A node whose container was killed stays "alive" in the GCS until its health checks fail. The
        # cluster is settled when every expected IP has a fresh live node, each IP only one, and every
        # replaced node is dead, so that no work can be scheduled on a ghost.
        settled = expected <= alive and len(fresh_ips) == len(alive) and not any(n["NodeID"] in stale for n in live)
        if settled or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    report = [
        {
            "node_ip": n["NodeManagerAddress"],
            "node_id": n["NodeID"],
            "hostname": n.get("NodeManagerHostname", ""),
            "alive": bool(n.get("Alive")),
            "resources": {k: v for k, v in n.get("Resources", {}).items() if not k.startswith("node:")},
        }
        for n in nodes
    ]
    _say(document, {"ok": settled, "nodes": report})
    return 0 if settled else 1


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
