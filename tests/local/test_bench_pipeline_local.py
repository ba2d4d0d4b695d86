"""The benchmark end to end on a throwaway single-node local Ray (stages stacked on that one node)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

from raycluster_cli.bench import experiment, outputcheck, session  # noqa: E402
from raycluster_cli.bench import workload as runtime  # noqa: E402
from raycluster_cli.bench.options import BenchOptions  # noqa: E402
from raycluster_cli.models.decoder import ModelConfig  # noqa: E402
from raycluster_cli.node import nodes  # noqa: E402
from raycluster_cli.node import stage_worker as pipeline  # noqa: E402
from raycluster_cli.placement.partition import even_partition  # noqa: E402

from ..bench_checkpoints import write_random_gpt2  # noqa: E402
from ..bench_report_checks import (  # noqa: E402
    assert_balance_is_the_stages,
    assert_ceiling_is_the_busiest_stage,
    assert_reference_is_the_same_workload,
)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    # A private throwaway cluster: no auth token written to ~/.ray, no dashboard.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            _node_ip_address="127.0.0.1",  # loopback only
        )
        try:
            yield
        finally:
            ray.shutdown()


def _run(**fields: Any) -> dict[str, Any]:
    """session.run with small, fast options (stages stacked on the one local node)."""
    base: dict[str, Any] = {
        "allow_shared_nodes": True,
        "threads": 1,
        "calibration_repeats": 1,
        "calibration_sample_s": 0.01,
        "vocab": 97,
        "d_model": 32,
    }
    events: list[tuple[Any, ...]] = []
    doc = session.run(BenchOptions(**{**base, **fields}), lambda *a, **k: events.append(a))
    assert events and all(isinstance(e[0], str) for e in events)  # every phase reported its progress
    return doc


def test_run_workload_completes_and_matches_unsharded_model(local_ray: None) -> None:
    cfg = ModelConfig(vocab=257, d_model=64, heads=4, layers=6, max_seq=24, seed=5)
    params = runtime.BenchParams(requests=10, prompt_len=8, max_new_tokens=5, micro_batch=3, seed=1)
    node_id = ray.get_runtime_context().get_node_id()
    with pytest.raises(ValueError, match="own node"):
        pipeline.start_workers(cfg, [node_id, node_id])
    workers = pipeline.start_workers(cfg, [node_id] * 3, num_threads=1, allow_shared_nodes=True)
    try:
        cal = pipeline.calibrate_workers(workers[:1], 3, 8, 4, repeats=3)[0]
        assert all(cal[f"{kind}_s"] > 0 for kind in nodes.UNIT_TYPES) and cal["repeats"] == 3
        assert len(pipeline.unit_cost_row(cal, cfg.layers)) == cfg.num_units
        ranges = [even_partition(cfg.layers, 3)]
        runtime.setup_replicas([workers], ranges)
        result = runtime.run_workload([workers], ranges, cfg, params)
        stats = ray.get([w.stats.remote() for w in workers])
    finally:
        pipeline.stop_workers(workers)

    assert result.completed == result.requests == 10
    assert result.generated_tokens == 10 * 5
    assert all(len(t) == 5 for t in result.tokens)
    assert result.in_flight >= 3
    assert [s.layers for s in result.stages] == [2, 2, 2]
    assert result.stages[0].has_embedding and result.stages[-1].has_head
    assert all(s.busy_s > 0 and s.cpu_s > 0 and s.idle_s >= 0 for s in result.stages)
    # 4 micro-batches x 5 steps per stage, warm-up excluded.
    assert all(s.calls == 4 * 5 for s in result.stages)
    assert sorted(r for g in result.groups for r in g) == list(range(10))
    assert all(s["cached_micro_batches"] == 0 for s in stats)  # every KV cache released
    assert all(0 < t <= e for t, e in zip(result.ttft_s, result.e2e_s, strict=True))
    assert len(result.tpot_s) == 10 and all(t > 0 for t in result.tpot_s)
    assert result.tokens_per_s > 0 and result.wall_s > 0
    table_ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
    assert {(s.node_id, s.node_ip) for s in result.stages} == {(node_id, table_ip)}
    check = outputcheck.check_output(cfg, params, result, num_requests=10)
    assert check == {"identical": True, "compared_requests": 10, "mismatched": []}


def test_both_hop_ways_give_the_same_tokens_and_are_measured_side_by_side(local_ray: None) -> None:
    """Stage to stage (each stage calls the next) and via the driver: same greedy tokens; hops timed both ways."""
    cfg = ModelConfig(vocab=257, d_model=64, heads=4, layers=6, max_seq=24, seed=5)
    node_id = ray.get_runtime_context().get_node_id()
    workers = pipeline.start_workers(cfg, [node_id] * 3, num_threads=1, allow_shared_nodes=True)
    try:
        ranges = [even_partition(cfg.layers, 3)]
        runtime.setup_replicas([workers], ranges)
        results = {
            hops: runtime.run_workload(
                [workers],
                ranges,
                cfg,
                runtime.BenchParams(requests=9, prompt_len=8, max_new_tokens=4, micro_batch=3, seed=2, hops=hops),
            )
            for hops in ("direct", "driver")
        }
        hop = pipeline.hop_overhead(workers, torch.zeros(3, 1, cfg.d_model), repeats=6)  # the default way
        direct = pipeline.hop_overhead(workers, torch.zeros(3, 1, cfg.d_model), repeats=6, hops="direct")
    finally:
        pipeline.stop_workers(workers)
    assert results["direct"].tokens == results["driver"].tokens
    assert all(len(t) == 4 for t in results["direct"].tokens)
    assert all(s.calls == 3 * 4 for s in results["direct"].stages)  # every stage ran every step
    assert hop["hops"] == "driver" and hop["per_hop_s"] == hop["per_hop_via_driver_s"] > 0
    assert hop["per_hop_direct_s"] > 0 and hop["via_driver_over_direct"] > 0
    assert direct["hops"] == "direct" and direct["per_hop_s"] == direct["per_hop_direct_s"]


def test_chunked_prefill_through_the_pipeline(local_ray: None) -> None:
    cfg = ModelConfig(vocab=257, d_model=64, heads=4, layers=6, max_seq=24, seed=5)
    params = runtime.BenchParams(requests=6, prompt_len=8, max_new_tokens=4, micro_batch=3, seed=2, prefill_chunk=3)
    node_id = ray.get_runtime_context().get_node_id()
    workers = pipeline.start_workers(cfg, [node_id] * 2, num_threads=1, allow_shared_nodes=True)
    try:
        cal = pipeline.calibrate_workers(workers[:1], 3, 8, 3, repeats=1, min_sample_s=0.0, prefill_chunk=3)[0]
        assert cal["block_s"] > 0
        ranges = [even_partition(cfg.layers, 2)]
        runtime.setup_replicas([workers], ranges)
        result = runtime.run_workload([workers], ranges, cfg, params)
        stats = ray.get([w.stats.remote() for w in workers])
    finally:
        pipeline.stop_workers(workers)
    assert result.completed == 6 and all(len(t) == 4 for t in result.tokens)
    # 2 micro-batches x (3 prompt pieces of 3/3/2 tokens + 3 decode steps) per stage.
    assert all(s.calls == 2 * (3 + 3) for s in result.stages)
    assert all(s["cached_micro_batches"] == 0 for s in stats)
    assert all(s.span_s > 0 and s.process_cpu_s >= s.cpu_s > 0 for s in result.stages)
    assert result.driver_cpu_s > 0
    # Both stages share this machine's cgroup: the other processes' share cannot be told apart.
    assert all(s.others_cpus == 0.0 and s.capacity_s == s.busy_s for s in result.stages)
    assert all(s.container_cpu_s is None or s.container_cpu_s >= s.process_cpu_s * 0.9 for s in result.stages)
    check = outputcheck.check_output(cfg, params, result, num_requests=6)
    assert check == {"identical": True, "compared_requests": 6, "mismatched": []}


def test_replicas_share_the_load_and_references_are_measured(local_ray: None) -> None:
    doc = _run(layers=4, stages=1, replicas=3, requests=24, micro_batch=2, partition="balanced")
    assert doc["config"]["replicas"] == 3 and doc["config"]["stages"] == 1
    assert doc["completed"] == doc["requests"] == 24
    replicas = doc["replicas"]
    assert [r["index"] for r in replicas] == [0, 1, 2]
    assert sum(r["requests"] for r in replicas) == 24
    assert all(r["requests"] > 0 and r["micro_batches"] > 0 for r in replicas)  # the router used every replica
    assert len(doc["stages"]) == 3 and all(s["predicted_s"] > 0 for s in doc["stages"])
    refs = doc["references"]
    assert_ceiling_is_the_busiest_stage(doc)
    assert_reference_is_the_same_workload(doc, "unsharded")
    assert_balance_is_the_stages(doc)
    assert "even" not in refs  # one stage per replica: the even split is the balanced one, nothing to compare
    assert doc["split_choice"] == {"used": "balanced", "reason": "the balanced split is the even split"}
    assert doc["hop_overhead"]["per_hop_s"] > 0
    assert {"embedding_s", "block_s", "head_s"} <= set(doc["calibration"]["nodes"][0])
    pilots = doc["calibration"]["refinements"]
    assert 1 <= len(pilots) <= 3
    chosen = [p["partition_ranges"] for p in pilots if p["chosen"]]
    assert all(ranges == doc["partition_ranges"][0] for ranges in chosen)  # "chosen": the split used
    assert all(set(p["mean_factors"]) == set(p["factors"]) for p in pilots)
    assert all(p["tokens_per_s"] > 0 and len(p["busy_s"]) == 3 for p in pilots)
    json.dumps(doc)  # what the driver prints
    for kind in ("ttft", "tpot", "e2e"):
        assert doc["latency_s"][kind]["p50"] is not None


def _checkpoint_run(path: Path, **extra: Any) -> dict[str, Any]:
    """A checkpoint through 3 balanced stages, every request's output compared with the unsharded model."""
    return _run(
        model_path=str(path),
        stages=3,
        requests=6,
        prompt_len=5,
        max_new_tokens=6,
        micro_batch=2,
        partition="balanced",
        check_output=True,
        check_requests=6,
        references=False,
        **extra,
    )


def test_gpt2_checkpoint_sharded_equals_unsharded(local_ray: None, tmp_path: Path) -> None:
    path = write_random_gpt2(tmp_path / "tiny-gpt2", layers=4, d_model=64, heads=4, vocab=128, positions=64)
    doc = _checkpoint_run(path)
    assert doc["config"]["model"]["layers"] == 4 and doc["config"]["model"]["activation"] == "gelu_new"
    assert doc["config"]["model_source"].startswith("gpt2:")
    assert sum(s["layers"] for s in doc["stages"]) == 4
    assert doc["output_check"] == {"identical": True, "compared_requests": 6, "mismatched": []}


def test_llama_checkpoint_through_the_pipeline_equals_unsharded(local_ray: None, tmp_path: Path) -> None:
    from tests.llama_checkpoint import GQA, write_llama

    path = write_llama(tmp_path / "tiny-llama", num_hidden_layers=4, **GQA)
    doc = _checkpoint_run(path, prefill_chunk=2)
    model = doc["config"]["model"]
    assert (model["arch"], model["layers"], model["kv_heads"], model["tied_head"]) == ("llama", 4, 2, False)
    assert doc["config"]["model_source"] == f"llama:{path}"
    assert sum(s["layers"] for s in doc["stages"]) == 4
    assert doc["output_check"] == {"identical": True, "compared_requests": 6, "mismatched": []}


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_qwen2_checkpoint_at_a_dtype_through_the_pipeline_equals_unsharded(
    local_ray: None, tmp_path: Path, dtype: str
) -> None:
    from tests.llama_checkpoint import GQA, write_llama

    path = write_llama(tmp_path / "tiny-qwen2", family="qwen2", num_hidden_layers=4, **GQA)
    doc = _checkpoint_run(path, dtype=dtype)
    model, choice = doc["config"]["model"], doc["config"]["dtype_choice"]
    assert (model["family"], model["qkv_bias"], doc["config"]["model_source"]) == ("qwen2", True, f"qwen2:{path}")
    assert choice["requested"] == dtype and choice["dtype"] == model["dtype"] == doc["config"]["dtype"]
    if dtype == "auto":  # a CPU run: measured, then chosen by the measurement
        from raycluster_cli.models.precision import MIN_GAIN

        # bfloat16 only for a lead over MIN_GAIN on every node, as precision.choose documents
        lead = all(p["bfloat16_s"] < (1 - MIN_GAIN) * p["float32_s"] for p in choice["probes"])
        assert choice["probes"] and model["dtype"] == ("bfloat16" if lead else "float32")
    else:
        assert model["dtype"] == "bfloat16" and "probes" not in choice
    assert doc["output_check"] == {"identical": True, "compared_requests": 6, "mismatched": []}


def test_poisson_mode_and_sweeps(local_ray: None) -> None:
    doc = _run(layers=2, stages=1, requests=8, rate=200, references=False, sweep="batch")
    assert doc["config"]["mode"] == "poisson" and doc["config"]["rate"] == 200
    assert doc["completed"] == 8
    points = doc["sweep"]["points"]
    assert [p["micro_batch"] for p in points] == [1, 2, 4, 8]
    assert doc["sweep"]["best_micro_batch"] in {1, 2, 4, 8}
    doc = _run(layers=2, requests=4, references=False, sweep="nodes")
    assert [p["nodes"] for p in doc["sweep"]["points"]] == [1]
    assert doc["sweep"]["points"][0]["efficiency"] == pytest.approx(1.0)


def test_default_run_sizes_the_model_and_the_work(local_ray: None) -> None:
    """No --layers, no --requests: layers from the calibration, requests from a measured pilot."""
    doc = _run(stages=3, duration_s=1.0, refine=1, min_blocks_per_node=2, max_new_tokens=4, references=False)
    assert doc["config"]["layers_auto"] and doc["config"]["requests_auto"]
    assert doc["config"]["model"]["layers"] >= experiment.MIN_AUTO_LAYERS
    # a 1 s run is short: the floor sizes it, 4 x (stages + 1) micro-batches of 4 requests
    assert doc["completed"] == doc["requests"] >= session.COUNTED_FLOOR * 4 * 4
    assert doc["split_choice"]["used"] in ("balanced", "even") and doc["split_choice"]["reason"]
    assert len(doc["window_tokens_per_s"]) == 5


def _kill_when_running(pid: int) -> Any:
    """A progress callback that SIGKILLs process ``pid`` once some requests completed: a real death."""
    killed: list[int] = []

    def report(step: str, done: int | None = None, total: int | None = None, **_: Any) -> None:
        if step == "requests" and done and not killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(done)

    return report


def test_a_replica_lost_mid_run_is_retried_on_the_others(local_ray: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "PROGRESS_EVERY_S", 0.0)  # a report per completed step: the kill lands mid-run
    cfg = ModelConfig(vocab=97, d_model=32, heads=4, layers=2, max_seq=24, seed=5)
    params = runtime.BenchParams(requests=60, prompt_len=8, max_new_tokens=6, micro_batch=2, seed=1)
    node_id = ray.get_runtime_context().get_node_id()
    workers = pipeline.start_workers(cfg, [node_id] * 3, num_threads=1, allow_shared_nodes=True)
    try:
        pid = ray.get(workers[2].node_info.remote())["pid"]
        ranges = [[(0, cfg.num_units)]] * 3
        runtime.setup_replicas([[w] for w in workers], ranges)
        result = runtime.run_workload([[w] for w in workers], ranges, cfg, params, _kill_when_running(pid))
    finally:
        pipeline.stop_workers(workers)
    assert result.completed == 60 and all(len(t) == 6 for t in result.tokens)
    [lost] = result.lost
    assert lost.replica == 2 and lost.stage == 0 and lost.node_id == node_id and "Actor" in lost.error
    assert result.retried_requests == lost.requests_retried > 0
    assert [r.lost for r in result.replicas] == [False, False, True]
    assert {s.replica for s in result.stages} == {0, 1}


def test_a_replica_lost_after_the_last_request_loses_only_its_stats(local_ray: None) -> None:
    """The node dies between the last token and the stats: the run stands, the replica is named lost."""
    cfg = ModelConfig(vocab=97, d_model=32, heads=4, layers=2, max_seq=24, seed=5)
    params = runtime.BenchParams(requests=12, prompt_len=8, max_new_tokens=4, micro_batch=2, seed=1)
    node_id = ray.get_runtime_context().get_node_id()
    workers = pipeline.start_workers(cfg, [node_id] * 2, num_threads=1, allow_shared_nodes=True)
    killed: list[int] = []

    def kill_at_the_end(step: str, done: int | None = None, total: int | None = None, **_: Any) -> None:
        if step == "requests" and done == total and not killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(1)

    try:
        pid = ray.get(workers[1].node_info.remote())["pid"]
        ranges = [[(0, cfg.num_units)]] * 2
        runtime.setup_replicas([[w] for w in workers], ranges)
        result = runtime.run_workload([[w] for w in workers], ranges, cfg, params, kill_at_the_end)
    finally:
        pipeline.stop_workers(workers)
    assert killed and result.completed == 12 and all(len(t) == 4 for t in result.tokens)
    [lost] = result.lost
    assert lost.replica == 1 and lost.requests_retried == 0 and "Actor" in lost.error
    assert [r.lost for r in result.replicas] == [False, True]
    assert {s.replica for s in result.stages} == {0}


def test_the_only_replica_lost_stops_the_run_with_the_counts(local_ray: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "PROGRESS_EVERY_S", 0.0)  # a report per completed step: the kill lands mid-run
    cfg = ModelConfig(vocab=97, d_model=32, heads=4, layers=3, max_seq=24, seed=5)
    params = runtime.BenchParams(requests=100, prompt_len=8, max_new_tokens=6, micro_batch=2, seed=1, in_flight=8)
    node_id = ray.get_runtime_context().get_node_id()
    workers = pipeline.start_workers(cfg, [node_id] * 3, num_threads=1, allow_shared_nodes=True)
    try:
        pid = ray.get(workers[1].node_info.remote())["pid"]
        ranges = [even_partition(cfg.layers, 3)]
        runtime.setup_replicas([workers], ranges)
        began = time.monotonic()
        with pytest.raises(runtime.StageLost) as caught:
            runtime.run_workload([workers], ranges, cfg, params, _kill_when_running(pid))
        assert time.monotonic() - began < 60
    finally:
        pipeline.stop_workers(workers)
    failure = caught.value.failure
    assert failure["stage"] == 1 and failure["replica"] == 0
    assert failure["completed"] + failure["failed"] == failure["requests"] == 100
    assert 0 < failure["completed"] < 100
    assert "stage 1" in str(caught.value) and "of 100 request(s) completed" in str(caught.value)
