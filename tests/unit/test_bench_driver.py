"""The driver's contract with the CLI: one JSON document on stdout, even on errors."""

from __future__ import annotations

import json

import pytest

from raycluster_cli.bench import driver


def _run(capfd: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, dict[str, object], str]:
    code = driver.main(argv)
    out, err = capfd.readouterr()
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    return code, json.loads(lines[0]), err


def test_bad_partition_is_one_json_error(capfd: pytest.CaptureFixture[str]) -> None:
    code, doc, _ = _run(capfd, ["--partition", "zigzag"])
    assert code == 1
    assert doc["schema_version"] == 1 and doc["ok"] is False
    assert "zigzag" in str(doc["error"]) and "\n" not in str(doc["error"])


def test_usage_error_is_json_too(capfd: pytest.CaptureFixture[str]) -> None:
    code, doc, _ = _run(capfd, ["--layers", "many"])
    assert code == 1 and doc["ok"] is False and "--layers" in str(doc["error"])


def test_impossible_manual_partition(capfd: pytest.CaptureFixture[str]) -> None:
    code, doc, _ = _run(capfd, ["--layers", "6", "--partition", "manual:4,4"])
    assert code == 1 and "holds 8 blocks" in str(doc["error"])


def test_choose_nodes() -> None:
    nodes = [{"node_id": "b", "node_ip": "10.0.0.2"}, {"node_id": "a", "node_ip": "10.0.0.10"}]
    assert driver.choose_nodes(nodes, 2, False) == nodes
    assert driver.choose_nodes(nodes, 1, False) == nodes[:1]
    assert [n["node_id"] for n in driver.choose_nodes(nodes, 3, True)] == ["b", "a", "b"]
    with pytest.raises(ValueError, match="allow-shared-nodes"):
        driver.choose_nodes(nodes, 3, False)
    with pytest.raises(RuntimeError):
        driver.choose_nodes([], 1, False)


def test_ip_sort_is_numeric() -> None:
    ips = ["10.0.0.10", "10.0.0.9", "192.168.1.1", "10.0.0.100"]
    assert sorted(ips, key=driver._ip_key) == ["10.0.0.9", "10.0.0.10", "10.0.0.100", "192.168.1.1"]
