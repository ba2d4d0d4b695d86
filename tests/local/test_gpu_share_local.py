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

from raycluster_cli.models.decoder import ModelConfig  # noqa: E402
from raycluster_cli.node import nodes  # noqa: E402
from raycluster_cli.node import stage_worker as pipeline  # noqa: E402

from ..local_ray import one_node_ray  # noqa: E402


@pytest.fixture(scope="module")
def one_gpu_ray() -> Iterator[str]:
    with one_node_ray(num_gpus=1) as node_id:  # told it has one GPU (Ray takes the count as given)
        yield node_id


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


def test_serves_stages_on_a_gpu_node_ask_ray_for_its_gpu(one_gpu_ray: str) -> None:
    """The service's stages (serve/stages.py) on a node with a GPU ask Ray for their share of it, as the bench's do:
    Ray then makes that GPU visible to them (CUDA_VISIBLE_DEVICES) and accounts for it.  Before, they asked for
    none, so on a GPU node each used the first GPU unaccounted, whatever else Ray had placed on it."""
    from raycluster_cli.node.nodes import node_gpus
    from raycluster_cli.serve.stages import start_stages

    cfg = ModelConfig(vocab=97, d_model=32, heads=4, layers=3, max_seq=16, seed=1)
    assert node_gpus() == {one_gpu_ray: 1.0}
    actors, _ = start_stages(
        cfg, [(0, 2), (2, 3), (3, 5)], 2, node_ids=[one_gpu_ray] * 3, gpus=node_gpus(), timeout_s=90
    )
    try:
        assert ray.available_resources().get("GPU", 0.0) == pytest.approx(0.0, abs=1e-3)  # a third each
        seen = ray.get([a.visible_gpus.remote() for a in actors], timeout=30)
        assert seen == ["0", "0", "0"], seen
    finally:
        for actor in actors:
            ray.kill(actor)


def test_gpu_shares_give_whole_gpus_while_there_are_enough_and_packable_parts_after() -> None:
    shares = nodes.gpu_shares
    assert shares(["a", "a", "b"], {}) == [0.0, 0.0, 0.0]  # no GPU anywhere: the CPU
    assert shares(["a", "a"], {"a": 2.0}) == [1.0, 1.0]  # one GPU each
    assert shares(["a", "a", "a"], {"a": 2.0}) == [0.5, 0.5, 0.5]  # 2 on one GPU, 1 on the other (2/3 would not pack)
    assert shares(["a", "b", "a"], {"a": 1.0, "b": 4.0}) == [0.5, 1.0, 0.5]
    assert shares(["a"], {"a": 0.5}) == [0.0]  # part of a GPU offered: not a GPU node
