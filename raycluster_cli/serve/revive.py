"""``python -m raycluster_cli.serve.revive RECORD --gcs HOST:PORT``: the head's container deploys again the service
it served before it stopped.

Ray keeps the Serve application in the GCS, and a GCS without an external Redis (Ray's GCS fault tolerance) starts
empty when the head's container starts again (its engine restarted, the host rebooted). The workers come back by
themselves (the containers' restart policy, host/containers.py), but nothing would deploy the service again. So the
launcher (serve/__main__.py), once the service generates, writes RECORD (``write``): the options it deployed with
(the model where the nodes read it, the split, the limits, the paths of the keys document and the TLS pair in the
head's container; never a key) and the node IPs its pipelines were placed on. The head's start script runs this
module in the background when RECORD exists. It waits for those nodes to be alive again (NODES_WAIT_S: a node that
does not come back is not waited for longer, the service is placed on those that did), then runs the launcher with
the same options, again RETRY_S after a failure, until DEADLINE_S. ``serve --stop`` removes RECORD, and a RECORD
removed while this waits ends it. Each step is one line in the container's log (``docker logs``), starting
``raycluster: revive:``. Only the standard library is imported here: the launcher and the node probe it runs are
processes of their own, so a head that starts without a service pays one Python start, not Ray's import.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

NODES_WAIT_S = 150.0  # for the service's nodes to be alive again (a worker notices its head left within ~60 s)
DEADLINE_S = 1200.0  # for the whole redeploy, retries included
RETRY_S = 20.0
LAUNCH_S = 600.0  # one launcher run (it measures the nodes, builds every stage and generates once)
PROBE_S = 30.0  # one look at the GCS's node table


def write(path: str, options: dict[str, Any], document: dict[str, Any]) -> None:
    """Keep what the launcher deployed (``options``, LaunchOptions' JSON) and the nodes its report (``document``)
    placed the pipelines on, whole (a temporary file renamed), readable by its owner only."""
    stages = [s for p in document.get("pipelines", []) if isinstance(p, dict) for s in p.get("stages", [])]
    ips = sorted({str(s["node_ip"]) for s in stages if isinstance(s, dict) and s.get("node_ip")})
    temp = f"{path}.{os.getpid()}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump({"options": options, "nodes": ips}, handle)
    os.replace(temp, path)


def read(path: str) -> tuple[dict[str, Any], list[str]] | None:
    """The options and node IPs ``write`` kept, None when there is no record or it cannot be read."""
    try:
        record = json.loads(Path(path).read_text())
        options, nodes = record["options"], record.get("nodes", [])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(options, dict) or not isinstance(nodes, list):
        return None
    return options, [str(ip) for ip in nodes]


def say(message: str) -> None:
    print(f"raycluster: revive: {message}", flush=True)


def wait_for_nodes(gcs: str, ips: list[str], until: float) -> bool:
    """Whether every node IP in ``ips`` is an alive Ray node before ``until`` (monotonic), asked of the GCS by
    host/probe.py (no driver), again while the GCS is not up yet or a node is missing."""
    while True:
        left = until - time.monotonic()
        if left <= 0:
            return False
        look = min(PROBE_S, left)
        command = [sys.executable, "-m", "raycluster_cli.host.probe", f"--address={gcs}", f"--timeout={look:.0f}"]
        try:
            done = subprocess.run(
                [*command, f"--expect={','.join(ips)}"], capture_output=True, text=True, timeout=look + 60
            )
        except subprocess.TimeoutExpired:
            continue
        if done.returncode == 0:
            return True
        time.sleep(min(2.0, max(0.0, until - time.monotonic())))


def launch(options: dict[str, Any], timeout_s: float) -> tuple[bool, str]:
    """Run the launcher with ``options``; whether it deployed, and its last line (its error, or its document)."""
    command = [sys.executable, "-m", "raycluster_cli.serve", "--options", json.dumps(options)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"the launcher did not return within {timeout_s:.0f}s"
    lines = (done.stdout if done.returncode == 0 else done.stderr).strip().splitlines()
    return done.returncode == 0, lines[-1][:300] if lines else f"exit {done.returncode}"


def revive(path: str, gcs: str, deadline_s: float = DEADLINE_S, nodes_wait_s: float = NODES_WAIT_S) -> int:
    """Deploy the service of the record at ``path`` again (see the module's docstring); 0 once deployed or when
    there is nothing to deploy, 1 when the deadline passed first."""
    found = read(path)
    if found is None:
        say(f"no readable record at {path}: nothing to deploy")
        return 0
    options, ips = found
    began = time.monotonic()
    end = began + deadline_s
    say(f"the head started again; waiting for the service's nodes {', '.join(ips) or '(any)'}")
    if not wait_for_nodes(gcs, ips, min(end, began + nodes_wait_s)):
        say(f"not every node is back within {nodes_wait_s:.0f}s: deploying on the nodes that are")
    while os.path.exists(path):
        ok, said = launch(options, min(LAUNCH_S, max(1.0, end - time.monotonic())))
        if ok:
            say(f"the service is deployed again after {time.monotonic() - began:.0f}s: {said}")
            return 0
        if time.monotonic() + RETRY_S >= end:
            say(f"gave up after {time.monotonic() - began:.0f}s: {said}")
            return 1
        say(f"the launcher failed ({said}); again in {RETRY_S:.0f}s")
        time.sleep(RETRY_S)
    say("the record was removed (serve --stop): nothing to deploy")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raycluster_cli.serve.revive", description=__doc__.splitlines()[0])
    parser.add_argument("record", help="the service's record (written by the launcher)")
    parser.add_argument("--gcs", required=True, help="the head's GCS address, HOST:PORT")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for the whole redeploy")
    parser.add_argument("--nodes-wait", type=float, default=NODES_WAIT_S, help="seconds to wait for the nodes")
    args = parser.parse_args(argv)
    return revive(args.record, args.gcs, args.deadline, args.nodes_wait)


if __name__ == "__main__":
    sys.exit(main())
