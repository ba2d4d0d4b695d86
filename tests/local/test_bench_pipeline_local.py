"""End-to-end pipeline on a throwaway single-node local Ray (stages stacked on that one node)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytestmark = [pytest.mark.slow]

ray = pytest.importorskip("ray")

from raycluster_cli.bench import pipeline  # noqa: E402
from raycluster_cli.bench.model import ModelConfig  # noqa: E402
from raycluster_cli.bench.partition import even_partition  # noqa: E402


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


def test_run_pipeline_completes_and_matches_unsharded_model(local_ray: None) -> None:
    cfg = ModelConfig(vocab=257, d_model=64, heads=4, layers=6, max_seq=24, seed=5)
    params = pipeline.BenchParams(requests=10, prompt_len=8, max_new_tokens=5, micro_batch=3, seed=1)
    node_id = ray.get_runtime_context().get_node_id()
    with pytest.raises(ValueError, match="own node"):
        pipeline.start_workers(cfg, [node_id, node_id])
    workers = pipeline.start_workers(cfg, [node_id] * 3, num_threads=1, allow_shared_nodes=True)
    try:
        costs = pipeline.calibrate_workers(workers[:1], params)
        assert len(costs[0]) == cfg.num_units and all(c > 0 for c in costs[0])
        result = pipeline.run_pipeline(workers, even_partition(cfg.layers, 3), cfg, params)
        stats = ray.get([w.stats.remote() for w in workers])
    finally:
        pipeline.stop_workers(workers)

    assert result.completed == result.requests == 10
    assert result.generated_tokens == 10 * 5
    assert all(len(t) == 5 for t in result.tokens)
    assert result.in_flight >= 3
    assert [s.layers for s in result.stages] == [2, 2, 2]
    assert result.stages[0].has_embedding and result.stages[-1].has_head
    assert all(s.busy_s > 0 for s in result.stages)
    # 4 micro-batches x 5 steps per stage, warm-up excluded.
    assert all(s.calls == 4 * 5 for s in result.stages)
    assert all(s["cached_micro_batches"] == 0 for s in stats)  # every KV cache released
    assert all(0 < t <= e for t, e in zip(result.ttft_s, result.e2e_s, strict=True))
    assert result.tokens_per_s > 0 and result.wall_s > 0
    table_ip = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
    assert {(s.node_id, s.node_ip) for s in result.stages} == {(node_id, table_ip)}
    check = pipeline.check_output(cfg, params, result, num_requests=10)
    assert check == {"identical": True, "compared_requests": 10}
