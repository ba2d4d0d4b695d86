"""benchmarks/engine_vs_vllm_summary.py: the issue-49 ratios are taken round by round, a run with failed requests is
left out of them, and a service that did not run leaves its ratios empty instead of failing the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.engine_vs_vllm_summary import load, main, summarize


def _write(out: Path, name: str, tokens: float, tpot: float, failed: int = 0) -> None:
    run = {"output_tokens_per_s": tokens, "failed": failed, "latency_s": {"tpot": {"p50": tpot}, "ttft": {"p50": 1.0}}}
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "runs" / f"{name}.json").write_text(json.dumps({"runs": [run]}))


def test_ratios_pair_the_runs_of_one_round(tmp_path: Path) -> None:
    for n, (vllm, one) in enumerate([(100.0, 50.0), (200.0, 50.0), (100.0, 80.0)]):
        _write(tmp_path, f"vllm-greedy-r{n}", vllm, 0.05)
        _write(tmp_path, f"one-greedy-r{n}", one, 0.1)
        _write(tmp_path, f"vllm-sampled-r{n}", vllm / 2, 0.05)
        _write(tmp_path, f"one-single-r{n}", 10.0, 0.11)
        _write(tmp_path, f"vllm-single-r{n}", 20.0, 0.1)
    _write(tmp_path, "one-greedy-r3", 500.0, 0.1)  # no vLLM run in round 3: not in a ratio
    _write(tmp_path, "vllm-warmup-r0", 1.0, 1.0)  # a warm-up is never counted
    summary = summarize(load(tmp_path))
    e1 = summary["ratios"]["E1 greedy: one host / vLLM"]
    assert e1 == {"median": 0.5, "min": 0.25, "max": 0.8, "n": 3}
    assert summary["ratios"]["E6 one at a time, TPOT p50: one host / vLLM"]["median"] == pytest.approx(1.1)
    assert summary["ratios"]["E3 sampled / greedy: vllm"]["median"] == 0.5
    assert summary["ratios"]["E2 greedy: three hosts / vLLM"] is None  # the lab's 3 hosts did not run
    assert summary["runs"]["one greedy"]["tokens"]["n"] == 4


def test_a_run_with_failed_requests_is_left_out(tmp_path: Path) -> None:
    _write(tmp_path, "vllm-greedy-r0", 100.0, 0.05)
    _write(tmp_path, "one-greedy-r0", 900.0, 0.01, failed=3)
    assert main([str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert "one greedy" not in summary["runs"] and summary["ratios"]["E1 greedy: one host / vLLM"] is None
