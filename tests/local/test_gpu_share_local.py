"""Stages stacked on one GPU node share its GPU: each asks Ray for an equal part of it. A local Ray told it has
one GPU (Ray takes the count as given; no CUDA is needed here): three stage workers on that node all start, and
together they hold the whole GPU. Asking for a whole GPU each, the second worker would wait for ever."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

ray = pytest.importorskip("ray")
pytest.importorskip("torch")

from raycluster_cli.bench import pipeline  # noqa: E402
from raycluster_cli.bench.model import ModelConfig  # noqa: E402


@pytest.fixture(scope="module")
def one_gpu_ray() -> Iterator[str]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            yield ray.get_runtime_context().get_node_id()
        finally:
            ray.shutdown()


def test_three_stages_on_a_one_gpu_node_share_its_gpu(one_gpu_ray: str) -> None:
    cfg = ModelConfig(vocab=97, d_model=32, heads=4, layers=3, max_seq=16, seed=1)
    started: list[Any] = []
    thread = threading.Thread(
        target=lambda: started.extend(
            pipeline.start_workers(
                cfg, [one_gpu_ray] * 3, num_threads=1, allow_shared_nodes=True, gpu_nodes={one_gpu_ray}
            )
        ),
        daemon=True,
    )
    thread.start()
    thread.join(timeout=90)
    assert not thread.is_alive(), "a stage worker waits for a GPU share it never gets"
    try:
        assert len(started) == 3
        assert ray.available_resources().get("GPU", 0.0) == pytest.approx(0.0, abs=1e-3)  # thirds, to 1e-4
        ids = ray.get([w.node_info.remote() for w in started])
        assert len(ids) == 3
    finally:
        pipeline.stop_workers(started)
