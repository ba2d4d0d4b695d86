"""The terminal rendering of a bench result: table, bar chart, latency, references, sweeps."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from raycluster_cli.render.base import Output
from raycluster_cli.render.bench import bench_progress, render_bench, save_svg
from raycluster_cli.verbs.bench import BenchEvent


def _doc() -> dict[str, Any]:
    stage = {"replica": 0, "has_embedding": False, "has_head": False, "idle_s": 0.5, "predicted_s": 1.0, "cpu_s": 0.25}
    lat = {"p50": 0.1, "p90": 0.2, "p99": 0.3}
    return {
        "stages": [
            {
                **stage,
                **{"index": 0, "host": "192.0.2.1", "layers": 16, "busy_s": 2.0, "has_embedding": True},
                **{"idle_fill_s": 0.1, "idle_between_s": 0.3, "idle_drain_s": 0.1, "quota_used": 0.99},
            },
            {
                **stage,
                **{"index": 1, "host": "192.0.2.2", "layers": 4, "busy_s": 1.0, "has_head": True},
                **{"idle_fill_s": 0.2, "idle_between_s": 0.1, "idle_drain_s": 0.2},
            },
        ],
        "replicas": [{"index": 0, "requests": 8, "micro_batches": 2}],
        "tokens_per_s": 123.4,
        "requests_per_s": 2.5,
        "completed": 8,
        "requests": 8,
        "wall_s": 3.2,
        "imbalance": 0.667,
        "utilisation": 0.75,
        "t_max_minus_t_min_s": 1.0,
        "latency_s": {"ttft": lat, "tpot": lat, "e2e": {"p50": None, "p90": None, "p99": None}},
        "hop_overhead": {"per_hop_s": 0.0012},
        "references": {
            "even": {"tokens_per_s": 80.0, "ratio": 1.54},
            "unsharded": {"tokens_per_s": 100.0, "ratio": 1.23, "host": "192.0.2.1"},
            "ceiling": {
                "tokens_per_s": 130.0,
                "ratio": 0.95,
                "gap": {"stage": "lab-h2", "busy_s": 8.0, "outside_span_s": 0.25, "idle_in_span_s": 0.5},
            },
        },
        "sweep": {"kind": "nodes", "points": [{"nodes": 1, "tokens_per_s": 50.0, "efficiency": 1.0, "imbalance": 0.0}]},
        "output_check": {"identical": True, "compared_requests": 8},
        "config": {"mode": "offline"},
    }


def test_render_bench_shows_every_part() -> None:
    buffer = io.StringIO()
    render_bench(Output(False, stdout=buffer, stderr=io.StringIO()), _doc())
    text = buffer.getvalue()
    for expected in (
        "192.0.2.1",
        "16+emb",
        "0.250",
        "4+head",
        "idle fill/between/drain: 192.0.2.1 0.10/0.30/0.10s (quota 99% used), 192.0.2.2 0.20/0.10/0.20s",
        "█" * 30,
        "█" * 15,
        "123.4 tokens/s",
        "imbalance 0.667",
        "time per output token",
        "1.20 ms",
        "vs even split 1.54×",
        "vs unsharded on 192.0.2.1 1.23×",
        "of the pipeline ceiling 0.95× (busiest stage lab-h2: 0.25s filling/draining, 0.50s idle between calls)",
        "efficiency vs linear",
        "identical",
    ):
        assert expected in text, expected


def test_render_bench_batch_sweep_names_the_best() -> None:
    doc = _doc()
    doc["sweep"] = {
        "kind": "batch",
        "best_micro_batch": 4,
        "points": [{"micro_batch": 4, "tokens_per_s": 10.0, "latency_s": {"ttft": {"p50": 0.5}}}],
    }
    buffer = io.StringIO()
    render_bench(Output(False, stdout=buffer, stderr=io.StringIO()), doc)
    assert "best micro-batch: 4" in buffer.getvalue()


def test_render_bench_shows_the_quota_imbalance_only_when_a_node_has_a_quota() -> None:
    doc = _doc()
    doc["imbalance_capacity"] = 0.123
    buffer = io.StringIO()
    render_bench(Output(False, stdout=buffer, stderr=io.StringIO()), doc)
    assert "against CPU quotas" not in buffer.getvalue()
    doc["stages"][1]["cpu_quota"] = 0.25
    buffer = io.StringIO()
    render_bench(Output(False, stdout=buffer, stderr=io.StringIO()), doc)
    assert "imbalance 0.667 (against CPU quotas 0.123)" in " ".join(buffer.getvalue().split())


def test_stages_are_labelled_by_host() -> None:
    buffer = io.StringIO()
    render_bench(Output(False, stdout=buffer, stderr=io.StringIO()), _doc())
    chart = buffer.getvalue().split("busy time T_i per node:")[1]
    assert "192.0.2.1 " in chart and "stage 0.0" not in buffer.getvalue()


def test_save_svg_writes_the_chart_and_the_sweep_curve(tmp_path: Path) -> None:
    doc = _doc()
    doc["sweep"] = {
        "kind": "nodes",
        "points": [
            {"nodes": 1, "tokens_per_s": 50.0, "efficiency": 1.0, "imbalance": 0.0},
            {"nodes": 2, "tokens_per_s": 90.0, "efficiency": 0.9, "imbalance": 0.1},
        ],
    }
    path = tmp_path / "bench.svg"
    save_svg(doc, path)
    svg = path.read_text()
    assert svg.startswith("<svg") and "busy&#160;time&#160;T_i" in svg
    assert "against&#160;linear" in svg and "100.0&#160;tok/s&#160;(linear)" in svg


def test_progress_without_a_terminal_is_lines_on_stderr() -> None:
    err = io.StringIO()
    output = Output(False, stdout=io.StringIO(), stderr=err)
    with bench_progress(output) as progress:
        progress(BenchEvent("calibrating 3 node(s)"))
        progress(BenchEvent("pilot 2/3", 0, 128, "requests"))
        progress(BenchEvent("pilot 2/3", 40, 128, "requests"))  # same phase, within seconds: no new line
        progress(BenchEvent("pilot 2/3", 128, 128, "requests"))
        progress(BenchEvent("pilot 2/3", 128, 128, "requests"))  # the same line twice: once
        progress(BenchEvent("counted run", None, None, "node lost", {"host": "192.0.2.13", "stage": 2, "retried": 8}))
    lines = err.getvalue().splitlines()
    assert lines[0].endswith("calibrating 3 node(s)")
    assert lines[1].endswith("pilot 2/3: requests 0/128") and lines[2].endswith("pilot 2/3: requests 128/128")
    assert "warning" in lines[3] and "192.0.2.13 (stage 2) lost; 8 request(s) retried" in lines[3]
    assert len(lines) == 4


def test_the_even_fallback_and_lost_nodes_are_said() -> None:
    doc = _doc()
    doc["config"] = {"partition": "balanced"}
    doc["split_choice"] = {"used": "even", "reason": "the even split measured 90.0 tok/s in its pilot"}
    doc["references"]["balanced"] = {"tokens_per_s": 85.0, "ratio": 1.06, "tokens_per_s_spread": 0.04}
    doc["lost_nodes"] = [
        {"host": "192.0.2.2", "stage": 0, "replica": 1, "phase": "counted run", "requests_retried": 6, "error": "x"}
    ]
    doc["retried_requests"] = 6
    buffer = io.StringIO()
    render_bench(Output(False, stdout=buffer, stderr=io.StringIO()), doc)
    text = buffer.getvalue()
    assert "used the even split: the even split measured 90.0" in text
    assert "vs balanced split 1.06× (85.0 tok/s ±2%)" in text
    assert "node lost: 192.0.2.2 (stage 0, replica 1) during counted run: 6 request(s) retried" in text


def test_render_bench_splits_the_busiest_stage_idle_into_fill_between_drain() -> None:
    doc = _doc()
    gap = {"stage": "lab-h1", "busy_s": 17.0, "idle_fill_s": 0.05, "idle_between_s": 3.9, "idle_drain_s": 0.25}
    doc["references"]["ceiling"]["gap"] = gap
    buffer = io.StringIO()
    render_bench(Output(False, stdout=buffer, stderr=io.StringIO()), doc)
    expected = "(busiest stage lab-h1 idle: 0.05s filling, 3.90s between calls, 0.25s draining)"
    assert expected in buffer.getvalue()
