"""doctor → up → bench → down on a real 3-host lab, in this order (the tests share one lab)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from raycluster_cli.lab import hosts as lab

from ..bench_report_checks import assert_balance_is_the_stages, assert_latencies_are_the_runs
from .conftest import IP1, IP2, IP3, Lab
from .faults import processes

pytestmark = pytest.mark.lab


@pytest.fixture
def broken_hosts_file(lab_hosts: Lab) -> Iterator[str]:
    """lab-h2's /etc/hosts maps its own name to 127.0.1.1 (the Debian installer's default)."""
    original = lab_hosts.sh("lab-h2", "cat /etc/hosts")
    bad = "127.0.0.1\tlocalhost\n127.0.1.1\tlab-h2\n"
    # /etc/hosts is a bind mount: rewrite its content in place, never rename over it.
    lab_hosts.sh("lab-h2", f"printf '{bad}' > /etc/hosts")
    yield lab_hosts.host("lab-h2").address
    lab_hosts.sh("lab-h2", f"cat > /etc/hosts <<'EOF'\n{original}EOF")


def test_doctor_passes_on_healthy_lab(lab_hosts: Lab) -> None:
    code, doc, err = lab_hosts.cli("doctor")
    assert code == 0, err
    assert doc["ok"] is True
    statuses = {(c["host"], c["id"]): c["status"] for c in doc["checks"]}
    assert all(status == "ok" for status in statuses.values()), statuses
    for host in lab_hosts.info.hosts:
        assert statuses[(host.address, "etc-hosts")] == "ok"
    assert statuses[(lab_hosts.info.hosts[0].address, "head-address")] == "ok"


def test_doctor_names_host_with_loopback_hostname(lab_hosts: Lab, broken_hosts_file: str) -> None:
    code, doc, _ = lab_hosts.cli("doctor")
    assert code == 1
    assert doc["ok"] is False
    failed = [c for c in doc["checks"] if c["status"] == "fail"]
    assert [(c["host"], c["id"]) for c in failed] == [(broken_hosts_file, "etc-hosts")]
    assert "127.0.1.1" in failed[0]["message"]
    assert f"{broken_hosts_file} lab-h2" in failed[0]["hint"]


def test_up_brings_three_alive_nodes(lab_hosts: Lab) -> None:
    """From no cluster (the lab is shared with the modules before this one, which may leave nodes running), so
    the tests after this one read the start of every node by this `up`."""
    code, _, err = lab_hosts.cli("down")
    assert code == 0, err
    code, doc, err = lab_hosts.cli("up")
    assert code == 0, err
    assert doc["ok"] is True
    assert doc["head"] == IP1
    # the head is where up says it is: Ray's GCS runs on lab-h1 and nowhere else
    for hostname, gcs in (("lab-h1", True), ("lab-h2", False), ("lab-h3", False)):
        running = processes(lab_hosts, hostname, r"(^|/)gcs_server( |$)")
        assert bool(running) is gcs, (hostname, running)
    assert sorted(n["host"] for n in doc["nodes"]) == sorted(h.address for h in lab_hosts.info.hosts)
    assert all(n["alive"] for n in doc["nodes"])


NODE_RECORDS = (
    'python -c "import json; from ray._raylet import GcsClient; '
    f"nodes = GcsClient(address='{IP1}:6379').get_all_node_info(timeout=30).values(); "
    "print(json.dumps([[n.node_manager_address, n.is_head_node, n.start_time_ms, n.temp_dir, n.session_dir] "
    'for n in nodes if n.state == 0]))"'
)


def test_the_workers_ray_started_before_the_head_registered_in_the_heads_folders(lab_hosts: Lab) -> None:
    """`up` of the test before: no worker's Ray waited for the head's node to register (Ray's own `ray start`
    would have). Each worker's raylet started (its node record's start time) before the head's `ray start`
    said "Ray runtime started." (the head registers after its dashboard, raylet and agents), and the worker's
    record names the head's temp and session folders, the ones the wait answered Ray's lookup with."""
    records = json.loads(lab_hosts.sh("lab-h1", f"docker exec raycluster-lab-head timeout 60 {NODE_RECORDS}"))
    nodes = {address: (head, start_ms, temp, session) for address, head, start_ms, temp, session in records}
    assert sorted(nodes) == sorted(h.address for h in lab_hosts.info.hosts)
    head = nodes[IP1]
    assert head[0] is True and head[2] == "/tmp/ray" and head[3].startswith("/tmp/ray/session_")
    said = lab_hosts.sh("lab-h1", "docker logs -t raycluster-lab-head 2>&1 | grep -m1 'Ray runtime started'")
    stamp = said.split()[0]  # RFC 3339 in UTC with nanoseconds: 2026-12-03T14:33:01.123456789Z
    registered_ms = datetime.fromisoformat(stamp[:23] + "+00:00").timestamp() * 1000
    for address in (IP2, IP3):
        is_head, start_ms, temp, session = nodes[address]
        assert (is_head, temp, session) == (False, head[2], head[3])
        assert start_ms < registered_ms, f"{address}'s raylet started {start_ms - registered_ms:.0f} ms after"


LOOKS = "ls /tmp | grep -c '^raycluster-look-.*\\.pid$' || true"


def test_up_asked_for_every_node_from_a_workers_container_not_the_heads(lab_hosts: Lab) -> None:
    """`up` of the tests before asked the GCS for every node (its look) from lab-h2's worker container, where
    Ray's CPU is idle once that node registered, not from the head's, whose CPU the head's own start needs."""
    worker = lab_hosts.sh("lab-h2", f'docker exec raycluster-lab-worker sh -c "{LOOKS}"').strip()
    head = lab_hosts.sh("lab-h1", f'docker exec raycluster-lab-head sh -c "{LOOKS}"').strip()
    assert (worker, head) == ("1", "0")


def test_second_up_changes_nothing(lab_hosts: Lab) -> None:
    code, doc, err = lab_hosts.cli("up")
    assert code == 0, err
    assert [n["action"] for n in doc["nodes"]] == ["running"] * 3


CONNECT = (
    f"python -c \"import ray; ray.init(address='{IP1}:6379'); print('nodes', sum(n['Alive'] for n in ray.nodes()))\""
)


def test_ray_refuses_a_client_with_the_wrong_token(lab_hosts: Lab) -> None:
    head = "raycluster-lab-head"
    lab_hosts.sh("lab-h1", f"docker exec {head} sh -c 'echo not-the-token > /tmp/wrong-token'")
    refused = lab_hosts.sh_result(
        "lab-h1", f"docker exec -e RAY_AUTH_TOKEN_PATH=/tmp/wrong-token {head} timeout 120 {CONNECT}"
    )
    assert refused.returncode != 0
    # the GCS refused the token itself (Ray 2.60 prints the cause under its ConnectionError), not the address
    assert "InvalidAuthToken: Authentication token is missing or incorrect" in refused.stderr, refused.stderr[-2000:]
    accepted = lab_hosts.sh("lab-h1", f"docker exec {head} timeout 120 {CONNECT}")
    assert "nodes 3" in accepted  # alive ones: a node replaced by an earlier test stays listed as dead


def test_token_is_not_in_docker_inspect_or_command_lines(lab_hosts: Lab) -> None:
    # The session's own state dir (conftest sets it): the token `up` made for this lab.
    token = (Path(os.environ["RAYCLUSTER_STATE_DIR"]) / "lab" / "auth-token").read_text().strip()
    assert len(token) >= 32
    for host in lab_hosts.info.hosts:
        inspect = lab_hosts.sh(host.hostname, "docker inspect $(docker ps -q --filter label=io.raycluster.cluster=lab)")
        assert token not in inspect
        assert "RAY_AUTH_TOKEN_PATH" in inspect
        processes = lab_hosts.sh(host.hostname, "ps -eo args")
        assert token not in processes
        mode = lab_hosts.sh(host.hostname, "stat -c %a /etc/raycluster/lab/auth-token").strip()
        assert mode == "600"


def test_up_heals_only_a_dead_worker(lab_hosts: Lab) -> None:
    lab_hosts.sh("lab-h3", "docker rm -f raycluster-lab-worker")
    code, doc, err = lab_hosts.cli("up")
    assert code == 0, err
    actions = {n["host"]: n["action"] for n in doc["nodes"]}
    assert actions == {IP1: "running", IP2: "running", IP3: "started"}
    assert all(n["alive"] for n in doc["nodes"])


def test_bench_runs_one_stage_per_host(lab_hosts: Lab) -> None:
    # every phase on the small model (--quick); the default model's shape is what `make demo` benches
    code, doc, err = lab_hosts.cli("bench", "--quick", "--check-output", timeout=900)
    assert code == 0, err
    stages = doc["stages"]
    assert len(stages) == 3
    assert len({s["host"] for s in stages}) == 3
    assert {s["host"] for s in stages} == {h.address for h in lab_hosts.info.hosts}
    assert sum(s["layers"] for s in stages) == doc["config"]["model"]["layers"]
    assert doc["completed"] == doc["requests"] and doc["failed"] == 0
    assert doc["generated_tokens"] == doc["requests"] * doc["config"]["max_new_tokens"]
    assert_balance_is_the_stages(doc)
    assert_latencies_are_the_runs(doc)
    assert doc["output_check"]["identical"] is True
    # The network between the head and each worker is measured before every bench.
    measured = {n["host"]: n["data"] for n in doc["network"] if n["id"] == "network"}
    assert set(measured) == {IP2, IP3}
    assert all(m["to_head_bps"] > 0 and m["from_head_bps"] > 0 for m in measured.values())


def test_down_removes_everything_and_is_idempotent(lab_hosts: Lab) -> None:
    code, doc, err = lab_hosts.cli("down")
    assert code == 0, err
    assert sorted(r["host"] for r in doc["removed"]) == sorted(h.address for h in lab_hosts.info.hosts)
    for host in lab_hosts.info.hosts:
        left = lab_hosts.sh(host.hostname, "docker ps -a --filter label=io.raycluster.cluster --format '{{.Names}}'")
        assert left.strip() == "", f"{host.hostname} still has {left}"
    code, doc, err = lab_hosts.cli("down")
    assert code == 0, err
    assert doc["removed"] == []


def test_a_foreign_container_named_like_ours_is_never_touched(lab_hosts: Lab) -> None:
    lab_hosts.sh("lab-h2", f"docker create --name raycluster-lab-worker {lab.NODE_IMAGE} sleep 1")
    try:
        code, doc, _ = lab_hosts.cli("down")
        assert code == 0 and doc["removed"] == []
        assert lab_hosts.sh("lab-h2", "docker ps -aq --filter name=raycluster-lab-worker").strip()
        code, doc, _ = lab_hosts.cli("up")
        assert code == 1
        assert IP2 in doc["error"]["message"] and "did not start" in doc["error"]["message"]
        assert "docker rm -f raycluster-lab-worker" in doc["error"]["hint"]
        assert lab_hosts.sh("lab-h2", "docker ps -aq --filter name=raycluster-lab-worker").strip()
    finally:
        lab_hosts.sh("lab-h2", "docker rm -f raycluster-lab-worker")
        lab_hosts.cli("down")
