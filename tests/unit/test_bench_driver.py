"""The driver's contract with the CLI: one JSON document on stdout, even on errors."""

from __future__ import annotations

import json

import pytest

from raycluster_cli.bench import driver, experiment


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


def test_ip_sort_is_numeric() -> None:
    ips = ["10.0.0.10", "10.0.0.9", "192.168.1.1", "10.0.0.100"]
    assert sorted(ips, key=experiment._ip_key) == ["10.0.0.9", "10.0.0.10", "10.0.0.100", "192.168.1.1"]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--mode", "poisson"], "needs --rate"),
        (["--mode", "offline", "--rate", "3"], "needs --mode poisson"),
        (["--rate", "-1"], "must be > 0"),
        (["--calibration-repeats", "0"], "calibration-repeats"),
        (["--model-path", "/nonexistent/gpt2"], "config.json not found"),
    ],
)
def test_bad_load_flags_are_one_json_error(capfd: pytest.CaptureFixture[str], argv: list[str], match: str) -> None:
    code, doc, _ = _run(capfd, argv)
    assert code == 1 and doc["ok"] is False and match in str(doc["error"])


def test_flags_parse() -> None:
    args = driver._normalise(driver.build_parser().parse_args(["--rate", "2.5", "--sweep", "batch", "--no-references"]))
    assert args.mode == "poisson" and args.rate == 2.5 and args.sweep == "batch" and args.references is False
    args = driver._normalise(driver.build_parser().parse_args([]))
    assert args.mode == "offline" and args.references is True and args.calibration_repeats == 5
