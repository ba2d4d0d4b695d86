"""`bench` on a diffusers checkpoint, on a real multi-node Ray started on loopback (``ray.cluster_utils.Cluster``).

Each Ray node is a real raylet with its own `memory` resource: three nodes that each hold the whole tiny pipeline
get a replica each; three nodes that each hold only one part get the parts as stages.  Every run's first image
is compared with diffusers' own StableDiffusionPipeline for the same prompt, seed and steps.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

ray = pytest.importorskip("ray")
pytest.importorskip("diffusers")
import ray._private.services as services  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from raycluster_cli.bench import session  # noqa: E402
from raycluster_cli.bench.options import BenchOptions  # noqa: E402
from raycluster_cli.diffusion import placing  # noqa: E402
from raycluster_cli.diffusion.parts import part_bytes  # noqa: E402
from raycluster_cli.render.base import Output  # noqa: E402
from raycluster_cli.render.bench import render_bench  # noqa: E402

from ..diffusion_checkpoint import write_tiny_sd  # noqa: E402

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_sd(tmp_path_factory.mktemp("sd") / "tiny-sd")


def _cluster(memory: list[int]) -> Iterator[Cluster]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        # every raylet and the GCS on loopback: Ray's Cluster helper otherwise addresses the GCS at the machine's
        # default-route IP whatever node_ip_address says (tests send traffic to loopback only)
        mp.setattr(services, "get_node_ip_address", lambda *args, **kwargs: "127.0.0.1")
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "memory": memory[0],
                "include_dashboard": False,
                "node_ip_address": "127.0.0.1",
            },
        )
        for room in memory[1:]:
            cluster.add_node(num_cpus=1, memory=room, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        try:
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


def _run(checkpoint: Path, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model_path": str(checkpoint), "image_steps": 3, "image_size": 16, "calibration_repeats": 1,
        "threads": 1, "check_output": True, "seed": 7,
    }  # fmt: skip
    return session.run(BenchOptions(**(base | fields)), lambda *a, **k: None)


@pytest.fixture
def roomy() -> Iterator[Cluster]:
    yield from _cluster([2048 * MIB] * 3)


def test_every_node_that_holds_the_pipeline_gets_a_replica_and_requests_follow_speed(
    roomy: Cluster, checkpoint: Path
) -> None:
    doc = _run(checkpoint, requests=12)
    assert doc["ok"] and doc["kind"] == "image"
    placement = doc["placement"]
    assert len(placement["replicas"]) == 3 and "a replica on each" in placement["why"]
    assert all(r["holders"][0]["parts"] == ["text", "unet", "vae"] for r in placement["replicas"])
    assert doc["images"] == 12 and sum(doc["per_replica"]) == 12
    # each image went to a replica when it could start there: every replica computed until the last images, so the
    # busy times differ by less than one image (calibration and learned seconds per image both reported)
    busy = [n["busy_s"] for n in doc["nodes"]]
    learned = doc["learned_s_per_image"]
    assert (
        len(learned) == 3 and all(s > 0 for s in learned) and all(r["s_per_image"] > 0 for r in placement["replicas"])
    )
    assert len(busy) == 3 and all(b > 0 for b in busy)
    assert max(busy) - min(busy) <= max(learned) + 0.05, (busy, learned, doc["per_replica"])
    assert sum(n["calls"] for n in doc["nodes"]) == 12
    assert doc["imbalance"] == pytest.approx((max(busy) - min(busy)) / (sum(busy) / 3), rel=1e-6)
    assert doc["output_check"]["identical"] is True, doc["output_check"]
    refs = doc["references"]
    assert refs["equal"]["per_replica"] == [4, 4, 4]
    assert refs["one_node"]["per_replica"] == [12] and len(refs["one_node"]["busy_s"]) == 1
    for ref in refs.values():
        assert ref["ratio"] == pytest.approx(doc["images_per_s"] / ref["images_per_s"], rel=1e-6)
    q = doc["latency_s"]
    assert 0 < q["p50"] <= q["p90"] <= q["p99"] <= doc["wall_s"]
    # what the operator reads: the placement, every node's T_i, the references and the check
    buffer = io.StringIO()
    render_bench(Output(False, stdout=buffer, stderr=io.StringIO()), doc)
    text = buffer.getvalue()
    assert "a replica on each" in text and text.count("text+unet+vae") >= 6  # 3 replicas, 3 T_i bars
    assert "÷ equal:" in text and "÷ one node on 127.0.0.1:" in text and ": identical" in text


@pytest.fixture
def small(checkpoint: Path) -> Iterator[Cluster]:
    weights = part_bytes(checkpoint)
    # each node holds any one part with its activations, none the whole pipeline
    act = placing.activation_bytes(16)
    one = int(max(weights.values()) * placing.WEIGHT_HEADROOM) + act + 1024
    assert one < int(sum(weights.values()) * placing.WEIGHT_HEADROOM) + act
    yield from _cluster([one] * 3)


def test_nodes_too_small_for_the_pipeline_hold_its_parts_as_stages(small: Cluster, checkpoint: Path) -> None:
    doc = _run(checkpoint, requests=4)
    placement = doc["placement"]
    assert "no node holds the whole pipeline" in placement["why"], placement
    (replica,) = placement["replicas"]
    assert [h["parts"] for h in replica["holders"]] == [["text"], ["unet"], ["vae"]]
    assert len({w["node_id"] for w in doc["workers"]}) == 3  # three raylets, one part each
    assert sorted(n["parts"][0] for n in doc["nodes"] if n["calls"] == 4) == ["text", "unet", "vae"]
    assert doc["output_check"]["identical"] is True, doc["output_check"]


def test_a_pipeline_no_node_set_can_hold_is_refused_with_the_numbers(checkpoint: Path) -> None:
    rooms = [placing.NodeRoom(f"n{i}", f"10.0.0.{i}", 1 * MIB) for i in range(3)]
    with pytest.raises(ValueError, match=r"the unet needs \d+ MiB and no node has it \(nodes: 10.0.0.0 1 MiB"):
        placing.place(rooms, part_bytes(checkpoint), 512)
