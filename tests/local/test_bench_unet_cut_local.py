"""`bench` on a diffusers checkpoint whose UNet fits no node, on a real multi-node Ray on loopback: the UNet is cut
by blocks across the nodes (chosen from each node's measured seconds per unit and its `memory`), and the image
equals diffusers' own StableDiffusionPipeline for the same prompt, seed and steps; a replica cut at every block
boundary gives the same image."""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.slow]

ray = pytest.importorskip("ray")
pytest.importorskip("diffusers")
from ray.cluster_utils import Cluster  # noqa: E402

from raycluster_cli.bench import images  # noqa: E402
from raycluster_cli.diffusion import (  # noqa: E402
    placing,
    unet_cut,
)
from raycluster_cli.diffusion.parts import ImageRequest, part_bytes  # noqa: E402
from raycluster_cli.render.base import Output  # noqa: E402
from raycluster_cli.render.bench import render_bench  # noqa: E402

from ..diffusion_checkpoint import diffusers_image, write_tiny_sd  # noqa: E402
from .test_bench_images_local import _cluster, _run  # noqa: E402

ROOM = 3_000_000  # bytes of Ray `memory` per node: a third of the UNet's units and the text encoder or VAE, not all


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_sd(tmp_path_factory.mktemp("sd") / "tiny-sd")


@pytest.fixture(scope="module")
def small(checkpoint: Path) -> Iterator[Cluster]:
    weights = part_bytes(checkpoint)
    assert int(weights["unet"] * placing.WEIGHT_HEADROOM) + placing.activation_bytes(16) > ROOM  # no node holds it
    yield from _cluster([ROOM] * 3)


def test_a_unet_no_node_holds_is_cut_by_blocks_and_gives_diffusers_image(small: Cluster, checkpoint: Path) -> None:
    doc = _run(checkpoint, requests=6)
    placement = doc["placement"]
    assert "the UNet cut by blocks" in placement["why"], placement["why"]
    cut = placement["unet_cut"]
    stages = cut["stages"]
    assert len(stages) >= 2 and sum(len(s["units"]) for s in stages) == len(cut["units"])
    assert [u for s in stages for u in s["units"]] == cut["units"]  # contiguous, in the forward's order
    assert all(n["planned_mib"] * 1024 * 1024 <= ROOM for n in cut["nodes"]), cut["nodes"]
    assert len(cut["probes"]) == 3 and all(all(u is not None for u in p["unit_s"]) for p in cut["probes"])
    (replica,) = placement["replicas"]
    parts = [h["parts"][0] for h in replica["holders"]]
    assert parts[0] == "text" and parts[-1] == "vae" and all(p.startswith("unet[") for p in parts[1:-1])
    unet_nodes = [n for n in doc["nodes"] if n["parts"][0].startswith("unet[")]
    assert all(n["calls"] == 6 * 3 for n in unet_nodes)  # every image's 3 steps through every stage
    assert doc["output_check"]["identical"] is True, doc["output_check"]
    ceiling = doc["references"]["ceiling"]
    assert 0 < ceiling["ratio"] <= 1.05 and ceiling["images_per_s"] > 0
    print(f"\n{placement['why']}\nceiling {ceiling}, images/s {doc['images_per_s']:.3f}")
    buffer = io.StringIO()
    render_bench(Output(False, stdout=buffer, stderr=io.StringIO()), doc)
    assert "cut by blocks" in buffer.getvalue() and "÷ ceiling" in buffer.getvalue()


def test_a_replica_cut_at_every_block_boundary_gives_diffusers_image(small: Cluster, checkpoint: Path) -> None:
    from raycluster_cli.diffusion.unet_workers import CutReplica

    names = unet_cut.unit_names(unet_cut.load_config(checkpoint))
    bounds = [0, 2, 3, 4, 5, len(names)]  # in+down_blocks.0 | down_blocks.1 | mid_block | up_blocks.0 | up+out
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    stages = [(nodes[i % 3], a, b) for i, (a, b) in enumerate(itertools.pairwise(bounds))]
    replica = CutReplica(str(checkpoint), nodes[0], stages, nodes[1], 1)
    try:
        requests = [ImageRequest(p, seed=s, steps=3, height=16, width=16) for p, s in (("a red tree", 5), ("a cat", 6))]
        ours = ray.get([replica.submit(r) for r in requests], timeout=600)
    finally:
        replica.kill()
    for request, image in zip(requests, ours, strict=True):
        theirs = diffusers_image(checkpoint, request.prompt, request.seed, request.steps, 16)
        assert float(np.abs(image - theirs).max()) <= images.CHECK_TOLERANCE
