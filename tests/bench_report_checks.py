"""What a bench report promises about its own figures, checked against the figures it is made of.

A report's balance is computed from its stages' busy times, its references are runs of the same workload,
and its latencies are those of the requests it counted: each check here fails when the report's figures stop
following from what was measured (a balance from the wrong stages, a reference of another workload, a latency
longer than the run).
"""

from __future__ import annotations

from typing import Any

import pytest


def assert_balance_is_the_stages(doc: dict[str, Any]) -> None:
    busy = [s["busy_s"] for s in doc["stages"]]
    assert all(b > 0 for b in busy), busy
    mean = sum(busy) / len(busy)
    assert doc["t_max_minus_t_min_s"] == pytest.approx(max(busy) - min(busy), rel=1e-6, abs=1e-9)
    assert doc["imbalance"] == pytest.approx((max(busy) - min(busy)) / mean, rel=1e-6, abs=1e-9)
    assert doc["utilisation"] == pytest.approx(sum(busy) / (len(busy) * max(busy)), rel=1e-6)
    # no stage is busy longer than the run it was measured in (clocks differ by a round trip)
    assert max(busy) <= doc["wall_s"] + 0.05, (busy, doc["wall_s"])


def assert_latencies_are_the_runs(doc: dict[str, Any]) -> None:
    latency = doc["latency_s"]
    new_tokens = doc["config"]["max_new_tokens"]
    for kind in ("ttft", "tpot", "e2e"):
        q = latency[kind]
        assert 0 < q["p50"] <= q["p90"] <= q["p99"], (kind, q)
    assert latency["e2e"]["p99"] <= doc["wall_s"] + 0.05, (latency["e2e"], doc["wall_s"])
    if new_tokens > 1:
        assert latency["ttft"]["p50"] < latency["e2e"]["p50"], latency
        assert latency["tpot"]["p99"] * (new_tokens - 1) <= latency["e2e"]["p99"] * 1.01, latency


def assert_reference_is_the_same_workload(doc: dict[str, Any], name: str) -> None:
    ref = doc["references"][name]
    # a reference runs the run's requests again: the same tokens in its own wall time
    assert ref["tokens_per_s"] * ref["wall_s"] == pytest.approx(doc["generated_tokens"], rel=0.02), (name, ref)
    assert ref["ratio"] == pytest.approx(doc["tokens_per_s"] / ref["tokens_per_s"], rel=1e-6), (name, ref)
    assert all(b > 0 for b in ref["busy_s"]), (name, ref)


def assert_ceiling_is_the_busiest_stage(doc: dict[str, Any]) -> None:
    ceiling = doc["references"]["ceiling"]
    busiest = max(s["busy_s"] for s in doc["stages"])
    replicas = max(1, len({s.get("replica", 0) for s in doc["stages"]}))
    if replicas == 1:
        assert ceiling["tokens_per_s"] == pytest.approx(doc["generated_tokens"] / busiest, rel=0.02), ceiling
    assert 0 < ceiling["ratio"] <= 1.02, ceiling  # a run cannot beat its busiest stage working without a pause
