"""The lab's pure parts: host addresses per lab name and subnet, and its folder per name."""

from __future__ import annotations

from pathlib import Path

import pytest

from raycluster_cli import lab
from raycluster_cli.errors import UsageError


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
