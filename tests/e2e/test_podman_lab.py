"""docker.engine: podman on a real lab: 3 hosts with Debian's podman (no Docker at all), the same node image,
host networking, token auth. `up` streams the image into each host's `podman load`; doctor, status, exec and
down run through the same engine layer as on Docker hosts.

The lab has its own name and subnet (RAYCLUSTER_PODMAN_LAB_NAME / _SUBNET) and its own cluster name, so it
lives beside the 3-host Docker lab; every test starts from no cluster and no node image on the hosts and
leaves no cluster behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raycluster_cli.errors import OperationError
from raycluster_cli.lab import hosts as lab

from .conftest import REQUIRE, Lab, _need_engine, lab_subnet

pytestmark = [pytest.mark.lab, pytest.mark.extended]

NAME = os.environ.get("RAYCLUSTER_PODMAN_LAB_NAME", f"{lab.LAB_NAME}-podman")
SUBNET = "10.76.0.0/24"  # RAYCLUSTER_PODMAN_LAB_SUBNET, or a free one; 10.77 lab, 10.78 network, 10.79 fleet
CLUSTER = "lab-podman"
HEAD, WORKER = f"raycluster-{CLUSTER}-head", f"raycluster-{CLUSTER}-worker"
HOSTNAMES = ("lab-h1", "lab-h2", "lab-h3")


@pytest.fixture(scope="module")
def podman_lab(tmp_path_factory: pytest.TempPathFactory, session_state: Path) -> Iterator[Lab]:
    _need_engine()
    lab_dir = Path(tmp_path_factory.mktemp("podman-lab"))
    try:
        info = lab.lab_up(
            3,
            lab_dir=lab_dir,
            name=NAME,
            subnet=lab_subnet("RAYCLUSTER_PODMAN_LAB_SUBNET", SUBNET, NAME),
            engine="podman",
            load_node_image=False,  # `up` streams it, into `podman load`
            progress=lambda m: print(f"[podman lab] {m}", file=sys.stderr),
        )
    except OperationError as exc:
        if REQUIRE:
            raise
        pytest.skip(f"no podman lab: {exc.message}")
    the_lab = Lab(info)

    def cluster(data: dict[str, Any]) -> None:
        data["cluster"] = CLUSTER

    inventory = the_lab.variant(lab_dir / "inventory-podman.yaml", cluster)
    the_lab.info.inventory_path = Path(inventory)
    try:
        yield the_lab
    finally:
        the_lab.cli("down", timeout=300)
        lab.lab_down(lab_dir=lab_dir, name=NAME, keep_volumes=os.environ.get("RAYCLUSTER_LAB_PURGE") != "1")


@pytest.fixture
def fresh_hosts(podman_lab: Lab) -> Iterator[Lab]:
    """No cluster, no node image and no bystander on the hosts before the test, and no cluster after it."""
    podman_lab.cli("down", timeout=300)
    for hostname in HOSTNAMES:
        podman_lab.sh(
            hostname, f"podman rm -f -t 0 bystander >/dev/null; podman rmi -f {lab.NODE_IMAGE} >/dev/null 2>&1; true"
        )
    try:
        yield podman_lab
    finally:
        podman_lab.cli("down", timeout=300)
        podman_lab.sh("lab-h2", "podman rm -f -t 0 bystander >/dev/null; true")


def _with_command(the_lab: Lab, verb: str, options: list[str], words: list[str]) -> tuple[int, dict[str, Any], str]:
    """`raycluster VERB -i INV --json OPTIONS -- WORDS` (the command last, after --) as a real process."""
    command = [sys.executable, "-m", "raycluster_cli.cli", verb, "-i", the_lab.inventory, "--json", *options, "--"]
    done = subprocess.run([*command, *words], capture_output=True, text=True, timeout=300)
    return done.returncode, json.loads(done.stdout), done.stderr


def _checks(doc: dict[str, Any]) -> dict[tuple[str, str], str]:
    return {(c["host"], c["id"]): c["status"] for c in doc["checks"]}


def test_podman_hosts_doctor_up_status_exec_logs_submit_down(fresh_hosts: Lab, tmp_path: Path) -> None:
    the_lab, out_dir = fresh_hosts, tmp_path / "logs"
    addresses = [h.address for h in the_lab.info.hosts]
    assert the_lab.sh_result("lab-h1", "command -v dockerd docker").returncode != 0  # a Podman-only machine

    # doctor: Podman answers; the image is all that is missing (and `up` streams it).
    code, doc, err = the_lab.cli("doctor")
    statuses = _checks(doc)
    assert code == 1, err
    assert {k for k, s in statuses.items() if s == "fail"} == {(a, "image") for a in addresses}, statuses
    assert all(statuses[(a, "docker")] == "ok" for a in addresses)

    # One `up`, no second try (a node that misses its start is started once more by `up` itself).
    code, doc, err = the_lab.cli("up", timeout=900)
    assert code == 0, err
    assert sorted(t["host"] for t in doc["images"]) == sorted(addresses)  # into podman load, streamed
    assert [(n["host"], n["alive"]) for n in doc["nodes"]] == [(a, True) for a in addresses]
    for hostname in HOSTNAMES:  # missing before `up` (doctor said so), loaded by it
        assert the_lab.sh_result(hostname, f"podman image exists {lab.NODE_IMAGE}").returncode == 0
    for hostname, name in zip(HOSTNAMES, (HEAD, WORKER, WORKER), strict=True):
        mode = the_lab.sh(hostname, f"podman inspect --format '{{{{.HostConfig.NetworkMode}}}}' {name}").strip()
        assert mode == "host"
        env = the_lab.sh(hostname, f"podman inspect --format '{{{{json .Config.Env}}}}' {name}")
        assert "RAY_AUTH_MODE=token" in env

    # Token auth: a client with the wrong token is refused, the node's own env is accepted.
    connect = f"python -c \"import ray; ray.init(address='{addresses[0]}:6379'); print('alive', len(ray.nodes()))\""
    the_lab.sh("lab-h1", f"podman exec {HEAD} sh -c 'echo not-the-token > /tmp/wrong-token'")
    refused = the_lab.sh_result("lab-h1", f"podman exec -e RAY_AUTH_TOKEN_PATH=/tmp/wrong-token {HEAD} {connect}")
    assert refused.returncode != 0 and "InvalidAuthToken" in refused.stderr, refused.stderr[-2000:]
    assert "alive 3" in the_lab.sh("lab-h1", f"podman exec {HEAD} timeout 120 {connect}")

    code, doc, err = the_lab.cli("up")
    assert code == 0 and [n["action"] for n in doc["nodes"]] == ["running"] * 3, err

    code, doc, err = the_lab.cli("status")
    assert code == 0, err
    assert [(h["host"], h["container"], h["ray_node"]) for h in doc["hosts"]] == [
        (a, "running", "alive") for a in addresses
    ]
    assert len({h["image_id"] for h in doc["hosts"]}) == 1 and doc["hosts"][0]["image_id"].startswith("sha256:")

    code, doc, err = _with_command(the_lab, "exec", ["--all"], ["hostname; echo $RAY_AUTH_MODE"])
    assert code == 0, err
    assert sorted(h["stdout"].split() for h in doc["hosts"]) == [[n, "token"] for n in HOSTNAMES]

    # logs: the container log streamed, Ray's session logs through `podman cp` (which follows session_latest).
    code, doc, err = the_lab.cli("logs", "--out", str(out_dir))
    assert code == 0, err
    assert [(h["host"], h["error"]) for h in doc["hosts"]] == [(a, "") for a in addresses]
    assert all(h["files"] > 1 and h["container_log_bytes"] > 0 for h in doc["hosts"]), doc["hosts"]

    # submit: the job's log comes through the dashboard's tail over SSH.
    code, doc, err = _with_command(the_lab, "submit", [], ["python", "-c", "print('hello from podman')"])
    assert code == 0 and doc["job"]["status"] == "SUCCEEDED", err
    assert doc["job"]["logs_via"] == "tail" and "hello from podman" in err

    # down removes this cluster's containers only: a bystander (labelled for another cluster) stays.
    the_lab.sh(
        "lab-h2",
        f"podman run -d --name bystander --label io.raycluster.cluster=other {lab.NODE_IMAGE} sleep 600 >/dev/null",
    )
    code, doc, err = the_lab.cli("down")
    assert code == 0, err
    assert sorted(r["host"] for r in doc["removed"]) == sorted(addresses)
    for hostname in HOSTNAMES:
        left = the_lab.sh(hostname, "podman ps -a --format '{{.Names}}'").split()
        assert left == (["bystander"] if hostname == "lab-h2" else []), (hostname, left)
        assert the_lab.sh_result(hostname, f"podman image exists {lab.NODE_IMAGE}").returncode == 0

    # doctor on the Podman hosts now that they hold the image: every check passes.
    the_lab.sh("lab-h2", "podman rm -f -t 0 bystander >/dev/null")
    code, doc, err = the_lab.cli("doctor")
    assert code == 0 and all(s == "ok" for s in _checks(doc).values()), (_checks(doc), err)
