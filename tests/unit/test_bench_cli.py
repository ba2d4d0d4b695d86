"""`raycluster bench` flag checks that happen before any host is contacted (exit 2, one line)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from raycluster_cli.bench.options import BenchOptions, flag_of
from raycluster_cli.cli import app as cli
from raycluster_cli.errors import ExitCode, UsageError
from raycluster_cli.lab import hosts as lab


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--sweep", "layers"], "--sweep 'layers' is not one of batch, nodes"),
        (["--mode", "closed"], "--mode 'closed' is not one of offline, poisson"),
        (["--mode", "poisson"], "--mode poisson needs --rate"),
        (["--rates", "1,2"], "--rates needs --serve"),
        (["--concurrency", "4"], "--concurrency needs --serve"),
        (["--serve", "--micro-batch", "8"], "--micro-batch is a pipeline-run flag; --serve does not use it"),
        (["--serve", "--rates", "1,fast"], "--rates: 'fast' is not a number"),
        (["--serve", "--rates", "0"], "--rates: '0' must be > 0"),
        (["--serve", "--output-tokens", "9:3"], "--output-tokens '9:3': needs 1 <= LOW <= HIGH"),
        (["--serve", "--rates", "", "--no-saturation"], "leave nothing to run"),
        (["--temperature", "0.8"], "--temperature needs --serve"),
        (["--serve", "--temperature", "-1"], "--temperature -1 must be >= 0"),
        (["--serve", "--top-p", "0"], "--top-p 0 must be in (0, 1]"),
        (["--serve", "--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]"),
    ],
)
def test_bad_bench_flags_are_usage_errors(args: list[str], match: str) -> None:
    result = CliRunner().invoke(cli.app, ["bench", "-i", "/nonexistent/inventory.yaml", *args, "--json"])
    assert result.exit_code == ExitCode.USAGE
    doc = json.loads(result.stdout)
    assert doc["ok"] is False and match in doc["error"]["message"] and doc["error"]["hint"]


def test_lab_cpu_quotas_go_to_the_hosts_in_order() -> None:
    assert lab.quota_options("1.0,0.5,0.25", 3) == {
        "lab-h1": ["--cpu-period=5000", "--cpu-quota=5000"],
        "lab-h2": ["--cpu-period=5000", "--cpu-quota=2500"],
        "lab-h3": ["--cpu-period=5000", "--cpu-quota=1250"],
    }
    assert lab.quota_options("0.5", 3) == {"lab-h1": ["--cpu-period=5000", "--cpu-quota=2500"]}
    with pytest.raises(UsageError, match="4 values for 3"):
        lab.quota_options("1,1,1,1", 3)
    with pytest.raises(UsageError, match="'fast' is not a number"):
        lab.quota_options("1,fast", 3)
    with pytest.raises(UsageError, match="'0' is not a number"):
        lab.quota_options("0", 3)


def test_a_lab_quota_uses_a_short_cfs_period_never_under_the_kernels_1ms_quota() -> None:
    # 5 ms periods: the share is spread over each call instead of 100 ms bursts (Docker's --cpus)
    assert lab.cpu_options("2") == ["--cpu-period=5000", "--cpu-quota=10000"]
    # 0.1 CPU of a 5 ms period would be 0.5 ms, which the kernel refuses: the period grows to 10 ms
    assert lab.cpu_options("0.1") == ["--cpu-period=10000", "--cpu-quota=1000"]
    assert lab.cpu_options("0.15") == ["--cpu-period=6667", "--cpu-quota=1000"]
    with pytest.raises(UsageError, match=r"^--cpus: 'x' is not a number"):
        lab.cpu_options("x", "--cpus")


def test_every_bench_option_is_a_flag() -> None:
    """The CLI's flags are the options model's fields: one list, nothing re-spelled."""
    result = CliRunner().invoke(cli.app, ["bench", "--help"], env={"COLUMNS": "300"})
    for name, spec in BenchOptions.model_fields.items():
        assert flag_of(name) in result.stdout, name
        if spec.annotation is bool:
            assert f"--no-{flag_of(name)[2:]}" in result.stdout, name


def test_switches_turn_off_with_no() -> None:
    result = CliRunner().invoke(
        cli.app, ["bench", "-i", "/nonexistent/inventory.yaml", "--no-references", "--check-output", "--json"]
    )
    assert "No such option" not in result.output  # the flags parse; the missing inventory is what fails
    assert result.exit_code == ExitCode.USAGE and "inventory" in result.stdout
