"""The fleet lab (30 hosts by default, no node image, beside the 3-host lab): every verb that reads all hosts
answers for every host, and the lab itself is what it says (its own name, network and addresses)."""

from __future__ import annotations

import ipaddress

import pytest

from raycluster_cli.lab import hosts as lab

from .conftest import FLEET_HOSTS, FLEET_NAME, Lab
from .findings import failed

pytestmark = [pytest.mark.lab, pytest.mark.fleet]


def test_fleet_lab_is_its_own_lab(fleet_lab: Lab) -> None:
    assert len(fleet_lab.info.hosts) == FLEET_HOSTS
    network = lab.docker_client().networks.get(FLEET_NAME)
    subnet = ipaddress.ip_network(network.attrs["IPAM"]["Config"][0]["Subnet"])
    assert all(ipaddress.ip_address(h.address) in subnet for h in fleet_lab.info.hosts)
    assert all(h.name.startswith(f"{FLEET_NAME}-h") for h in fleet_lab.info.hosts)
    client = lab.docker_client()
    mine = client.containers.list(filters={"label": f"{lab.LAB_LABEL}={FLEET_NAME}"})
    assert sorted(c.name for c in mine) == sorted(h.name for h in fleet_lab.info.hosts)
    # No node image on the fleet hosts: what image distribution starts from.
    last = fleet_lab.info.hosts[-1].hostname
    assert fleet_lab.sh_result(last, f"docker image inspect {lab.NODE_IMAGE}").returncode != 0


def test_doctor_reports_every_fleet_host(fleet_lab: Lab) -> None:
    code, doc, err = fleet_lab.cli("doctor", timeout=300)
    addresses = {h.address for h in fleet_lab.info.hosts}
    assert code == 1, err  # the node image is missing everywhere
    assert {c["host"] for c in doc["checks"]} >= addresses
    failures = failed(doc)
    assert {h for h, _ in failures} == addresses
    others = [c for c in doc["checks"] if c["status"] == "fail" and not c["id"].startswith("image")]
    assert not others, [(c["host"], c["id"], c["message"]) for c in others]
    assert not [c for c in doc["checks"] if c["id"] in {"ssh", "docker"} and c["status"] != "ok"]


def test_status_and_down_answer_for_every_fleet_host(fleet_lab: Lab) -> None:
    addresses = {h.address for h in fleet_lab.info.hosts}
    code, doc, err = fleet_lab.cli("status", timeout=300)
    assert code == 1, err  # no cluster runs on the fleet
    assert {h["host"] for h in doc["hosts"]} == addresses
    # every host answered (none unreachable or in error), and each says what it holds: no container of ours
    assert {h["host"]: (h["container"], h["healthy"], h["error"]) for h in doc["hosts"]} == {
        a: ("missing", False, "") for a in addresses
    }, [h for h in doc["hosts"] if h["container"] != "missing" or h["error"]]
    assert doc["state"] == "down" and doc["totals"]["alive_nodes"] == 0
    for _ in range(2):  # idempotent: nothing to remove, and no host fails to say so
        code, doc, err = fleet_lab.cli("down", timeout=300)
        assert code == 0, err
        assert (doc["removed"], doc["errors"], doc["purged"]) == ([], [], []), doc
