"""The driver's contract with the CLI: options as JSON in, one JSON document on stdout, even on errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raycluster_cli.bench import driver
from raycluster_cli.bench.options import BenchOptions
from raycluster_cli.node import nodes
from raycluster_cli.schema import SCHEMA_VERSION


def _run(capfd: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, dict[str, object], str]:
    code = driver.main(argv)
    out, err = capfd.readouterr()
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    return code, json.loads(lines[0]), err


def test_bad_options_are_one_json_error(capfd: pytest.CaptureFixture[str]) -> None:
    code, doc, _ = _run(capfd, ["--options", json.dumps({"partition": "zigzag"})])
    assert code == 1
    assert doc["schema_version"] == SCHEMA_VERSION and doc["ok"] is False
    assert "zigzag" in str(doc["error"]) and "\n" not in str(doc["error"])


def test_unknown_option_and_bad_json_are_json_errors(capfd: pytest.CaptureFixture[str]) -> None:
    code, doc, _ = _run(capfd, ["--options", json.dumps({"layerz": 3})])
    assert code == 1 and doc["ok"] is False and "layerz" in str(doc["error"])
    code, doc, _ = _run(capfd, ["--options", "{not json"])
    assert code == 1 and doc["ok"] is False
    code, doc, _ = _run(capfd, ["--no-such-flag"])
    assert code == 1 and doc["ok"] is False


def test_options_come_from_a_file_as_the_cli_writes_them(tmp_path: Path) -> None:
    path = tmp_path / "options.json"
    sent = BenchOptions(layers=6, rate=2.5, sweep="batch", references=False)
    path.write_text(sent.model_dump_json())
    assert driver.parse_options(f"@{path}") == sent
    assert driver.parse_options("{}") == BenchOptions()


def test_an_option_newer_than_the_node_image_names_the_mismatch_and_the_fix() -> None:
    with pytest.raises(driver._UsageError) as caught:
        driver.parse_options('{"layers": 6, "added_in_a_later_cli": 1}')
    message = str(caught.value)
    assert message.startswith("added_in_a_later_cli: unknown to raycluster ") and "older than the CLI" in message
    assert "build-images.sh" in message and "raycluster up" in message


def test_one_model_one_set_of_defaults() -> None:
    """The defaults the driver runs with are the ones the CLI shows: there is only one model."""
    options = BenchOptions()
    assert options.partition == "balanced" and options.layers is None and options.requests is None
    assert options.load_mode == "offline" and BenchOptions(rate=3).load_mode == "poisson"


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"mode": "poisson"}, "needs --rate"),
        ({"mode": "offline", "rate": 3}, "needs --mode poisson"),
        ({"rate": -1}, "greater than 0"),
        ({"calibration_repeats": 0}, "greater than or equal to 1"),
        ({"partition": "manual:4,x"}, "manual needs block counts"),
        ({"d_model": 30, "heads": 4}, "divisible"),
    ],
)
def test_bad_load_options_are_refused(fields: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BenchOptions.model_validate(fields)


def test_quick_fills_only_what_was_not_given() -> None:
    quick = BenchOptions(quick=True, requests=40).effective()
    assert quick.requests == 40 and quick.refine == 1 and quick.duration_s == 0.0
    assert BenchOptions(refine=2).effective().refine == 2


def test_missing_checkpoint_is_a_json_error(capfd: pytest.CaptureFixture[str]) -> None:
    code, doc, _ = _run(capfd, ["--options", json.dumps({"model_path": "/nonexistent/gpt2"})])
    assert code == 1 and doc["ok"] is False and "config.json not found" in str(doc["error"])


def test_ip_sort_is_numeric() -> None:
    ips = ["10.0.0.10", "10.0.0.9", "192.168.1.1", "10.0.0.100"]
    assert sorted(ips, key=nodes._ip_key) == ["10.0.0.9", "10.0.0.10", "10.0.0.100", "192.168.1.1"]


def test_progress_file_appends_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "progress.jsonl"
    progress = driver.ProgressFile(str(path))
    progress("pilot 1/3", 4, 32, step="requests")
    progress("counted run")
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert events[0]["phase"] == "pilot 1/3" and events[0]["done"] == 4 and events[0]["total"] == 32
    assert events[1] == {**events[1], "phase": "counted run", "done": None}
