"""The lab's pure parts: host addresses per lab name and subnet, and its folder per name."""

from __future__ import annotations

from pathlib import Path

import pytest

from raycluster_cli.errors import UsageError
from raycluster_cli.lab import hosts as lab


def test_hosts_of_a_named_lab_in_its_own_subnet() -> None:
    hosts = lab.lab_hosts(30, "10.87.0.128/25", "fleet")
    assert hosts[0] == lab.LabHost("fleet-h1", "lab-h1", "10.87.0.139")
    assert hosts[-1] == lab.LabHost("fleet-h30", "lab-h30", "10.87.0.168")


def test_more_hosts_than_the_subnet_holds_is_a_usage_error() -> None:
    with pytest.raises(UsageError) as info:
        lab.lab_hosts(21, "10.87.0.0/27", "x")
    assert "10.87.0.0/27" in info.value.message and "1 to 20" in info.value.hint
    with pytest.raises(UsageError):
        lab.lab_hosts(lab.MAX_HOSTS + 1, "10.0.0.0/16", "x")


def test_each_lab_name_has_its_own_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RAYCLUSTER_LAB_DIR", raising=False)
    monkeypatch.setenv("RAYCLUSTER_STATE_DIR", str(tmp_path))
    assert lab.default_lab_dir("raycluster-lab") != lab.default_lab_dir("fleet")
    assert lab.default_lab_dir("fleet").name == "lab-fleet"


class _Network:
    def __init__(self, name: str, subnets: list[str], lab_name: str | None = None) -> None:
        self.name = name
        labels = {lab.LAB_LABEL: lab_name} if lab_name else {}
        self.attrs = {"IPAM": {"Config": [{"Subnet": s} for s in subnets]}, "Labels": labels}


class _Networks:
    def __init__(self, networks: list[_Network]) -> None:
        self.networks = networks

    def list(self, names: list[str] | None = None) -> list[_Network]:
        return [n for n in self.networks if names is None or n.name in names]

    def create(self, name: str, **_: object) -> None:
        from docker.errors import APIError

        raise APIError("overlap", explanation="Pool overlaps with other one on this address space")


class _Client:
    def __init__(self, *networks: _Network) -> None:
        self.networks = _Networks(list(networks))


def test_a_free_subnet_is_the_preferred_one_unless_another_network_holds_it() -> None:
    client = _Client(
        _Network("bridge", ["172.17.0.0/16"]), _Network("v6", ["fd00::/64"]), _Network("mine", ["10.76.0.0/24"])
    )
    assert lab.free_subnet("10.76.0.0/24", "mine", client) == "10.76.0.0/24"  # the lab's own network is no obstacle
    client.networks.networks += [_Network("left", ["10.76.0.0/16"], "old"), _Network("x", ["10.64.0.0/23"])]
    assert lab.free_subnet("10.76.0.0/24", "new", client) == "10.64.2.0/24"


def test_a_held_subnet_names_the_lab_that_holds_it_and_how_to_remove_it() -> None:
    client = _Client(_Network("rc-final-podman", ["10.76.0.0/24"], "rc-final-podman"))
    with pytest.raises(lab.OperationError) as info:
        lab._ensure_network(client, "raycluster-lab-podman", "10.76.0.0/24")
    assert "held by rc-final-podman (10.76.0.0/24)" in info.value.message
    assert "raycluster lab down --name rc-final-podman" in info.value.hint
