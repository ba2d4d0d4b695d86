"""exec, submit and dashboard: usage errors, exit codes and the JSON document, without a lab."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from raycluster_cli.cli import app as cli
from raycluster_cli.errors import ExitCode

from .test_cli import refused_inventory  # noqa: F401  (the fixture)

runner = CliRunner()


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(cli.app, list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("verb", [["exec", "--", "true"], ["submit", "--", "true"], ["dashboard"]])
def test_missing_inventory_is_a_usage_error(verb: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAYCLUSTER_INVENTORY", raising=False)
    code, out, _err = invoke(verb[0], "--json", *verb[1:])
    assert code == ExitCode.USAGE
    doc = json.loads(out)
    assert doc["ok"] is False and "inventory.yaml not found" in doc["error"]["message"]


def test_exec_on_an_unknown_host_names_it(refused_inventory: Path) -> None:  # noqa: F811
    code, _out, err = invoke("exec", "-i", str(refused_inventory), "--host", "192.0.2.77", "--", "true")
    assert code == ExitCode.USAGE and "192.0.2.77 is not in the inventory" in err and "Traceback" not in err


def test_exec_on_an_unreachable_host_is_255_like_ssh(refused_inventory: Path) -> None:  # noqa: F811
    code, out, _ = invoke("exec", "-i", str(refused_inventory), "--json", "--", "true")
    doc = json.loads(out)
    assert code == 255 and doc["rc"] == 255 and "connection refused" in doc["hosts"][0]["error"]


def test_submit_without_the_clusters_token_says_where_it_should_be(
    refused_inventory: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RAYCLUSTER_STATE_DIR", str(tmp_path / "state"))
    code, out, _ = invoke("submit", "-i", str(refused_inventory), "--json", "--", "python", "x.py")
    doc = json.loads(out)
    assert code == ExitCode.FAILED and doc["ok"] is False
    assert "no Ray token for cluster t" in doc["error"]["message"] and "raycluster up" in doc["error"]["hint"]
