"""benchmarks/bench_targets_summary.py records what a run measured, also when it fell back to the even split."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _summary() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_targets_summary", ROOT / "benchmarks/bench_targets_summary.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


summary = _summary()


def test_balanced_run_reads_the_even_reference() -> None:
    doc = {"split_choice": {"used": "balanced"}, "references": {"even": {"ratio": 1.4}}}
    assert summary.balanced_over_even(doc) == pytest.approx(1.4)


def test_a_fallback_to_even_reports_the_measured_balanced_reference_inverted() -> None:
    # the even split ran as the main run at 0.8x... of the balanced reference's tokens/s: balanced ÷ even = 1.25
    doc = {
        "split_choice": {"used": "even", "reason": "the pilot was faster"},
        "references": {"balanced": {"ratio": 0.8}},
    }
    assert summary.balanced_over_even(doc) == pytest.approx(1.25)


def test_a_fallback_without_a_balanced_measurement_is_not_counted_as_met() -> None:
    doc = {"split_choice": {"used": "even", "reason": "the pilot was faster"}, "references": {}}
    assert summary.balanced_over_even(doc) is None


def test_the_same_split_is_one() -> None:
    doc = {"split_choice": {"used": "balanced", "reason": "the balanced split is the even split"}, "references": {}}
    assert summary.balanced_over_even(doc) == 1.0
