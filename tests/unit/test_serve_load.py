"""The serving benchmark's load and statistics (verbs/serve_load.py): seeded requests, Poisson arrivals,
per-request TPOT, each run's percentiles and throughput, and T_i per stage from two status reads."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from raycluster_cli.verbs.serve_load import (
    WORDS,
    RequestResult,
    front_end_cpu,
    make_requests,
    parse_range,
    parse_rates,
    poisson_arrivals,
    stage_times,
    summarize,
)


def test_requests_are_repeatable_for_a_seed_and_mixed_in_length() -> None:
    one = make_requests(64, 7, (8, 40), (4, 30), tokens_per_word=1.0)
    assert one == make_requests(64, 7, (8, 40), (4, 30), tokens_per_word=1.0)
    assert one != make_requests(64, 8, (8, 40), (4, 30), tokens_per_word=1.0)
    assert all(8 <= r.words <= 40 and 4 <= r.max_tokens <= 30 for r in one)
    assert len({r.words for r in one}) > 10 and len({r.max_tokens for r in one}) > 10  # mixed, not one length
    assert all(len(r.prompt.split()) == r.words and set(r.prompt.split()) <= set(WORDS) for r in one)


def test_a_prompt_is_sized_by_the_services_tokens_per_word() -> None:
    # two tokens per word: a 40-token prompt is 20 words (rounded down, never above the range)
    specs = make_requests(20, 1, (40, 40), (5, 5), tokens_per_word=2.0)
    assert {r.words for r in specs} == {20}
    specs = make_requests(20, 1, (41, 41), (5, 5), tokens_per_word=2.0)
    assert {r.words for r in specs} == {20}


def test_poisson_arrivals_have_the_asked_rate_and_exponential_gaps() -> None:
    times = poisson_arrivals(4000, 5.0, seed=3)
    assert times == poisson_arrivals(4000, 5.0, seed=3) and times[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 5.0, rel=0.06)
    # exponential: the standard deviation equals the mean, and about e^-1 of gaps exceed the mean
    assert statistics.stdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.1)
    assert sum(g > 0.2 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.03)
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0, seed=0)


def _result(index: int, ttft: float, e2e: float, tokens: int, itl: list[float]) -> RequestResult:
    return RequestResult(index, tokens, ttft_s=ttft, e2e_s=e2e, prompt_tokens=10, output_tokens=tokens, itl_s=itl)


def test_a_runs_summary_counts_throughput_and_percentiles() -> None:
    results = [
        _result(0, 0.1, 1.0, 10, [0.1] * 9),  # TPOT (1.0 - 0.1) / 9 = 0.1
        _result(1, 0.3, 2.3, 11, [0.2] * 10),  # TPOT 0.2
        RequestResult(2, 5, error="HTTP 503: full"),
    ]
    run = summarize(results, wall_s=2.5)
    assert (run["requests"], run["completed"], run["failed"]) == (3, 2, 1)
    assert run["errors"] == ["HTTP 503: full"]
    assert run["output_tokens"] == 21 and run["prompt_tokens"] == 20
    assert run["output_tokens_per_s"] == pytest.approx(21 / 2.5) and run["requests_per_s"] == pytest.approx(2 / 2.5)
    lat = run["latency_s"]
    assert lat["tpot"]["p50"] == pytest.approx(0.15) and lat["tpot"]["mean"] == pytest.approx(0.15)
    assert lat["ttft"]["p99"] == pytest.approx(0.1 + 0.99 * 0.2)
    assert lat["itl"]["p50"] == pytest.approx(0.2) and lat["itl"]["mean"] == pytest.approx(2.9 / 19)
    assert lat["e2e"]["p90"] == pytest.approx(1.0 + 0.9 * 1.3)


def test_nothing_completed_gives_none_not_nan() -> None:
    run = summarize([RequestResult(0, 4, error="TimeoutError")], wall_s=1.0)
    assert run["completed"] == 0 and run["latency_s"]["ttft"] == {"p50": None, "p90": None, "p99": None, "mean": None}
    assert RequestResult(0, 1, ttft_s=0.1, e2e_s=0.2, output_tokens=1).tpot_s is None  # one token: no TPOT


def _status(*stages: tuple[int, float, int, int]) -> dict[str, object]:
    """One pipeline; each stage (pid, busy_s, steps, blocks)."""
    rows = [
        {
            "node_ip": f"10.0.0.{i + 1}",
            "blocks": b,
            "pid": pid,
            "busy_s": busy,
            "steps": steps,
            "cpu_s": busy * 2,
            "forward_cpu_s": busy,
            "node_cpu_s": 10 * busy,
            "node_cpu_quota": 0.5,
        }
        for i, (pid, busy, steps, b) in enumerate(stages)
    ]
    anatomy = {"steps": 3, "round_trip_ms": 30.0}
    return {"pipelines": [{"index": 0, "state": "live", "stages": rows, "anatomy": anatomy}]}


def test_stage_times_diff_the_counters_and_judge_the_balance() -> None:
    before = _status((11, 1.0, 100, 2), (12, 4.0, 100, 1))
    after = _status((11, 3.0, 150, 2), (12, 5.0, 150, 1))
    got = stage_times(before, after, wall_s=4.0)
    assert [(s["node_ip"], s["busy_s"], s["steps"]) for s in got["stages"]] == [
        ("10.0.0.1", 2.0, 50),
        ("10.0.0.2", 1.0, 50),
    ]
    assert got["stages"][0]["cpu_s"] == pytest.approx(4.0) and got["stages"][0]["forward_cpu_s"] == pytest.approx(2.0)
    assert got["t_max_minus_t_min_s"] == pytest.approx(1.0)
    assert got["imbalance"] == pytest.approx(1.0 / 1.5)
    assert got["utilisation"] == pytest.approx(3.0 / 4.0)
    assert got["of_ceiling"] == pytest.approx(2.0 / 4.0)
    assert got["anatomy"] == {"0": {"steps": 3, "round_trip_ms": 30.0}}
    # node 1's container used 20 CPU-s over 4 s at a 0.5-CPU quota: 10 times its share (the figures are made up)
    assert [s["node_cpu_share"] for s in got["stages"]] == [10.0, 5.0]
    # the CPU each forward got per busy second: stage 1 computed 1.6 of its 2.0 busy seconds; none if never busy
    assert [s["forward_cpu_per_busy_s"] for s in got["stages"]] == [1.0, 1.0]
    held = _status((11, 3.0, 150, 2), (12, 5.0, 150, 1))
    held["pipelines"][0]["stages"][0]["forward_cpu_s"] = 1.0 + 1.6  # type: ignore[index]
    assert stage_times(before, held, wall_s=4.0)["stages"][0]["forward_cpu_per_busy_s"] == pytest.approx(0.8)
    idle = stage_times(before, before, wall_s=4.0)["stages"]
    assert [s["forward_cpu_per_busy_s"] for s in idle] == [None, None]
    assert (
        stage_times(before, after, wall_s=0)["stages"][0]["node_cpu_share"] is None
    )  # the step anatomy at the run's end


def test_the_garbage_collections_of_a_run_are_the_difference_of_the_two_reads() -> None:
    before = _status((11, 1.0, 100, 2), (12, 4.0, 100, 1))
    after = _status((11, 3.0, 150, 2), (12, 5.0, 150, 1))
    before["ingress_gc"] = {"full_collections": 3, "total_s": 0.02, "max_ms": 8.0}
    after["ingress_gc"] = {"full_collections": 7, "total_s": 0.05, "max_ms": 9.5}
    after["pipelines"][0]["stages"][0]["gc_s"] = 0.25  # stage 0 counts them from this read on; stage 1 does not
    got = stage_times(before, after, wall_s=4.0)
    assert got["ingress_gc"]["full_collections"] == 4 and got["ingress_gc"]["seconds"] == pytest.approx(0.03)
    assert got["ingress_gc"]["max_ms"] == 9.5
    assert [s["gc_s"] for s in got["stages"]] == [0.25, None]
    assert stage_times(_status((11, 1.0, 1, 1)), _status((11, 2.0, 2, 1)), 1.0)["ingress_gc"] is None


def test_the_front_ends_cpu_of_a_run_is_the_difference_of_the_two_reads_per_token() -> None:
    before = {"front_end": {"ingress_pid": 7, "ingress_cpu_s": 10.0, "proxy_pid": 8, "proxy_cpu_s": 4.0}}
    after = {"front_end": {"ingress_pid": 7, "ingress_cpu_s": 13.0, "proxy_pid": 8, "proxy_cpu_s": 5.5}}
    got = front_end_cpu(before, after, output_tokens=2000)
    assert got == {"ingress_cpu_s": 3.0, "ingress_ms_per_token": 1.5, "proxy_cpu_s": 1.5, "proxy_ms_per_token": 0.75}
    replaced = {"front_end": dict(after["front_end"], proxy_pid=9)}  # a new proxy: its seconds count from its start
    assert front_end_cpu(before, replaced, 2000)["proxy_cpu_s"] is None
    no_proxy = {"front_end": dict(after["front_end"], proxy_pid=None, proxy_cpu_s=None)}
    assert front_end_cpu(before, no_proxy, 2000)["proxy_ms_per_token"] is None
    assert front_end_cpu(before, after) == {"ingress_cpu_s": 3.0, "proxy_cpu_s": 1.5}  # no tokens: no rates
    assert front_end_cpu({}, {}, 10) is None  # a service that does not report its front end


def test_a_rebuilt_stage_counts_from_zero_and_an_unanswered_one_is_left_out() -> None:
    before = _status((11, 1.0, 100, 2), (12, 4.0, 100, 1))
    after = _status((21, 0.5, 20, 2), (12, 5.0, 150, 1))  # stage 0's actor was replaced (a new pid)
    got = stage_times(before, after, wall_s=2.0)
    assert [s["busy_s"] for s in got["stages"]] == [0.5, 1.0] and got["stages"][0]["steps"] == 20
    assert got["pipelines_changed"] is None  # the same pipeline, one actor rebuilt
    resplit = {"pipelines": [dict(after["pipelines"][0], index=1)]}  # type: ignore[index]
    assert stage_times(before, resplit, 2.0)["pipelines_changed"] == {"retired": [0], "new": [1]}
    silent = {"pipelines": [{"index": 0, "stages": [{"node_ip": "x"}], "counters_error": "TimeoutError"}]}
    assert stage_times(before, silent, 1.0)["stages"] == [] and stage_times(before, silent, 1.0)["imbalance"] is None


@pytest.mark.parametrize(
    ("text", "want"), [("32", (32, 32)), ("8:64", (8, 64)), ("bad", None), ("9:3", None), ("0:4", None)]
)
def test_ranges(text: str, want: tuple[int, int] | None) -> None:
    if want is None:
        with pytest.raises(ValueError, match="--prompt-tokens"):
            parse_range(text, "--prompt-tokens")
    else:
        assert parse_range(text, "--prompt-tokens") == want


def test_rates() -> None:
    assert parse_rates("0.5, 1,2") == [0.5, 1.0, 2.0] and parse_rates("") == []
    with pytest.raises(ValueError, match="'x' is not a number"):
        parse_rates("1,x")
    with pytest.raises(ValueError, match="must be > 0"):
        parse_rates("0")
