"""doctor → up → bench → down on a real 3-host lab, in this order (the tests share one lab)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .conftest import Lab

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
    code, doc, err = lab_hosts.cli("up")
    assert code == 0, err
    assert doc["ok"] is True
    assert doc["head"] == lab_hosts.info.hosts[0].address
    assert sorted(n["host"] for n in doc["nodes"]) == sorted(h.address for h in lab_hosts.info.hosts)
    assert all(n["alive"] for n in doc["nodes"])


def test_second_up_changes_nothing(lab_hosts: Lab) -> None:
    code, doc, err = lab_hosts.cli("up")
    assert code == 0, err
    assert [n["action"] for n in doc["nodes"]] == ["running"] * 3


def test_bench_runs_one_stage_per_host(lab_hosts: Lab) -> None:
    code, doc, err = lab_hosts.cli("bench", "--check-output", timeout=900)
    assert code == 0, err
    stages = doc["stages"]
    assert len(stages) == 3
    assert len({s["host"] for s in stages}) == 3
    assert {s["host"] for s in stages} == {h.address for h in lab_hosts.info.hosts}
    assert all(s["busy_s"] > 0 for s in stages)
    assert sum(s["layers"] for s in stages) == doc["config"]["model"]["layers"]
    assert doc["completed"] == doc["requests"]
    assert doc["tokens_per_s"] > 0
    assert doc["imbalance"] >= 0
    assert doc["output_check"]["identical"] is True


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
