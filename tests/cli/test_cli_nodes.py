"""drain, undrain and down --host: bad input named in one line with its fix, and the --json document, without a
lab (the host's SSH port refuses connections, so nothing reaches a cluster)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from raycluster_cli.cli import app as cli
from raycluster_cli.errors import ExitCode

from .test_cli import refused_inventory  # noqa: F401  (the fixture)

runner = CliRunner()


@pytest.fixture(autouse=True)
def _state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYCLUSTER_STATE_DIR", str(tmp_path / "state"))


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(cli.app, list(args))
    return result.exit_code, result.stdout, result.stderr


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("verb", [["drain"], ["undrain"], ["drain", "--undo"], ["down", "--host"]])
def test_an_unknown_host_is_named_with_the_hosts_there_are(verb: list[str], refused_inventory: Path) -> None:  # noqa: F811
    code, out, err = invoke(*verb, "192.0.2.77", "-i", str(refused_inventory))
    line = one_line(err)
    assert code == ExitCode.USAGE and out == ""
    assert "host 192.0.2.77 is not in the inventory" in line and "use one of: 127.0.0.1" in line


def test_an_unknown_host_in_json_is_the_error_document(refused_inventory: Path) -> None:  # noqa: F811
    code, out, _ = invoke("drain", "192.0.2.77", "--json", "-i", str(refused_inventory))
    doc = json.loads(out)
    assert code == ExitCode.USAGE and doc["ok"] is False
    assert "192.0.2.77" in doc["error"]["message"] and "127.0.0.1" in doc["error"]["hint"]


def test_a_negative_deadline_is_named(refused_inventory: Path) -> None:  # noqa: F811
    code, _, err = invoke("drain", "127.0.0.1", "--deadline", "-5", "-i", str(refused_inventory))
    line = one_line(err)
    assert code == ExitCode.USAGE and "--deadline -5 is negative" in line


def test_down_host_refuses_the_head_and_names_the_whole_cluster_down(refused_inventory: Path) -> None:  # noqa: F811
    code, _, err = invoke("down", "--host", "127.0.0.1", "-i", str(refused_inventory))
    line = one_line(err)
    assert code == ExitCode.USAGE and "127.0.0.1 is the head" in line and "raycluster down" in line


def test_down_host_and_purge_exclude_each_other(refused_inventory: Path) -> None:  # noqa: F811
    code, _, err = invoke("down", "--host", "127.0.0.1", "--purge", "-i", str(refused_inventory))
    assert code == ExitCode.USAGE and "--host and --purge exclude each other" in one_line(err)


def test_drain_on_an_unreachable_head_fails_in_json_naming_it(refused_inventory: Path) -> None:  # noqa: F811
    code, out, _ = invoke("drain", "127.0.0.1", "--json", "-i", str(refused_inventory))
    doc = json.loads(out)
    assert code not in (ExitCode.OK, ExitCode.USAGE) and doc["ok"] is False
    assert "127.0.0.1" in doc["error"]["message"] and "refused" in doc["error"]["message"]
