"""The terminal rendering of a bench result: table, bar chart, latency, references, sweeps."""

from __future__ import annotations

import io
from typing import Any

from raycluster_cli.report import Output
from raycluster_cli.report_bench import render_bench


def _doc() -> dict[str, Any]:
    stage = {"replica": 0, "has_embedding": False, "has_head": False, "idle_s": 0.5, "predicted_s": 1.0, "cpu_s": 0.25}
    lat = {"p50": 0.1, "p90": 0.2, "p99": 0.3}
    return {
        "stages": [
            {**stage, "index": 0, "host": "192.0.2.1", "layers": 16, "busy_s": 2.0, "has_embedding": True},
            {**stage, "index": 1, "host": "192.0.2.2", "layers": 4, "busy_s": 1.0, "has_head": True},
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
