"""`raycluster bench` flag checks that happen before any host is contacted (exit 2, one line)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from raycluster_cli import cli
from raycluster_cli.errors import ExitCode


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--sweep", "layers"], "--sweep 'layers' is not one of batch, nodes"),
        (["--mode", "closed"], "--mode 'closed' is not one of offline, poisson"),
        (["--mode", "poisson"], "--mode poisson needs --rate"),
    ],
)
def test_bad_bench_flags_are_usage_errors(args: list[str], match: str) -> None:
    result = CliRunner().invoke(cli.app, ["bench", "-i", "/nonexistent/inventory.yaml", *args, "--json"])
    assert result.exit_code == ExitCode.USAGE
    doc = json.loads(result.stdout)
    assert doc["ok"] is False and match in doc["error"]["message"] and doc["error"]["hint"]
