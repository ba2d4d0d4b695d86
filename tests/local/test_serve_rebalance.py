"""The serving fleet re-splits a pipeline from its real stages' times under load, on a local two-node Ray.

Two Ray nodes on this machine (``ray.cluster_utils.Cluster``: two raylets, two node ids), a two-stage pipeline
pinned one stage per node.  The calibration handed to the fleet is wrong on purpose (it says the first node is
three times faster per unit than the second, so the first stage got most blocks), as a calibration taken while a
node was idle is wrong once it serves; the nodes are in fact alike.  Under load the first stage's seconds per step,
read from the stage actors' own counters, are above what the plan modelled, so ``RayFleet.rebalance`` offers a
split with fewer blocks on the first node, and keeps the corrected costs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from raycluster_cli.models.decoder import config_from_checkpoint  # noqa: E402
from raycluster_cli.placement.pipelines import NodeSpeed, split_over  # noqa: E402
from raycluster_cli.serve import fleet as fleet_module  # noqa: E402
from raycluster_cli.serve.fleet import RayFleet  # noqa: E402
from raycluster_cli.serve.pool import Pipeline  # noqa: E402
from raycluster_cli.serve.scheduler import Limits  # noqa: E402
from raycluster_cli.serve.text import Sampling, eos_ids  # noqa: E402

from ..serve_checkpoint import WORDS, write_chat_llama  # noqa: E402

SIZES = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 8}


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[list[str]]:
    import ray._private.ray_constants as ray_constants
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        # Ray resolves 127.0.0.1 to this machine's outward address unless told it is no cluster: loopback only
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 2, "include_dashboard": False, "node_ip_address": "127.0.0.1"},
        )
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
        try:
            ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
            cluster.wait_for_nodes()
            yield [str(n["NodeID"]) for n in ray.nodes() if n["Alive"]]
        finally:
            ray.shutdown()
            cluster.shutdown()


def test_a_stage_slower_than_its_calibration_is_re_split_from_its_counters(
    two_nodes: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_chat_llama(tmp_path / "rebalance-llama", **SIZES)
    cfg = config_from_checkpoint(path, max_seq=128)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    eos = eos_ids(tokenizer, json.loads((path / "generation_config.json").read_text()))
    units = cfg.num_units
    first, second = sorted(two_nodes)
    wrong = [NodeSpeed(first, "n1", (1e-3 / 3,) * units), NodeSpeed(second, "n2", (1e-3,) * units)]
    plan = split_over(wrong)
    limits = Limits(slots=8, step_tokens=64, prefill_chunk=16, max_seq=128, max_waiting=64)
    fleet = RayFleet(cfg, tokenizer, limits, eos, stages=2, speeds=wrong, num_threads=1)
    monkeypatch.setattr(fleet_module, "REBALANCE_MIN_STEPS", 20)

    async def run() -> tuple[Any, Any]:
        engine, actors = await fleet.build(plan, 0)
        pipeline = Pipeline(0, plan, engine, actors)
        try:

            async def one(index: int) -> None:
                prompt = tokenizer.encode(" ".join(WORDS[(index + j) % len(WORDS)] for j in range(6)))
                async for _ in engine.generate(prompt, 24, Sampling(temperature=0)):
                    pass

            async def load() -> None:
                await asyncio.gather(*(one(i) for i in range(16)))

            warm = asyncio.ensure_future(load())
            await asyncio.sleep(0.5)
            opened = await fleet.rebalance(pipeline)  # the first look only opens the window
            await warm
            await load()
            return opened, await fleet.rebalance(pipeline)
        finally:
            await engine.close()
            for actor in actors:
                ray.kill(actor)

    opened, found = asyncio.run(run())
    assert opened is None and found is not None
    blocks = [b - a for a, b in plan.ranges]
    now = [b - a for a, b in found.ranges]
    assert found.node_ids == plan.node_ids and now[0] < blocks[0], (plan.ranges, found.ranges)
    assert "measured under load" in found.why
    assert fleet.speeds[first].unit_costs[1] > wrong[0].unit_costs[1]  # the corrected cost is kept
