"""The UNet cut by blocks: diffusers' own submodules in stages give the library's own noise prediction at every cut,
each stage holding only its own weights; the carry's bytes; the search of the cut by speed, memory and carry."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from raycluster_cli.diffusion import placing, unet_cut
from raycluster_cli.diffusion.parts import part_bytes
from raycluster_cli.diffusion.unet_place import NodeCosts, search

from ..diffusion_checkpoint import write_tiny_sd

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_sd(tmp_path_factory.mktemp("sd") / "tiny-sd")


@pytest.fixture(scope="module")
def library_unet(checkpoint: Path):  # type: ignore[no-untyped-def]
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(str(checkpoint / "unet")).eval()


def _cuts(count: int, pairs: bool) -> list[tuple[int, ...]]:
    """Every single cut, and with ``pairs`` every pair of cuts."""
    return [(c,) for c in range(1, count)] + (list(itertools.combinations(range(1, count), 2)) if pairs else [])


@pytest.mark.parametrize("side", [8, 6])  # 6: the up blocks are given their output size (forward_upsample_size)
def test_stages_cut_at_every_boundary_give_the_library_unets_output(checkpoint: Path, library_unet, side: int) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(side)
    x, context = torch.randn(2, 4, side, side, generator=gen), torch.randn(2, 16, 32, generator=gen)
    t = torch.tensor(801)
    with torch.no_grad():
        theirs = library_unet(x, t, encoder_hidden_states=context, return_dict=False)[0]
    names = unet_cut.unit_names(unet_cut.load_config(checkpoint))
    assert names == ["in", "down_blocks.0", "down_blocks.1", "mid_block", "up_blocks.0", "up_blocks.1", "out"]
    for cuts in _cuts(len(names), pairs=side == 8):
        bounds = [0, *cuts, len(names)]
        y: object = x
        for a, b in itertools.pairwise(bounds):
            y = unet_cut.UNetStage(checkpoint, a, b).forward(y, t, context)  # type: ignore[arg-type]
        assert isinstance(y, torch.Tensor)
        # the same modules, the same calls in the same order, in one process: measured 0.0 at every cut
        assert float((y - theirs).abs().max()) <= 1e-6, cuts
    assert float(theirs.abs().max()) > 0.01


def test_a_stage_holds_only_its_own_weights_and_the_carry_is_what_meta_shapes_say(checkpoint: Path) -> None:
    sizes = unet_cut.unit_bytes(checkpoint)
    assert sum(sizes.values()) == part_bytes(checkpoint)["unet"]  # every weight in a unit (a scheduler has none)
    stage = unet_cut.UNetStage(checkpoint, 2, 4)  # down_blocks.1, mid_block
    assert stage.weight_bytes() == sizes["down_blocks.1"] + sizes["mid_block"]
    assert all(p.device.type == "meta" for p in stage.model.up_blocks.parameters())
    assert all(p.device.type == "meta" for p in stage.model.down_blocks[0].parameters())
    # the bytes across each cut, computed on meta tensors, are those the real stages hand over
    crossing = unet_cut.crossing_bytes(checkpoint, 2, 8, 8, 16, 32)
    x, context, t = torch.randn(2, 4, 8, 8), torch.randn(2, 16, 32), torch.tensor(1)
    carry: object = x
    for index in range(len(crossing)):
        carry = unet_cut.UNetStage(checkpoint, index, index + 1).forward(carry, t, context)  # type: ignore[arg-type]
        assert isinstance(carry, unet_cut.Carry) and carry.nbytes() == crossing[index], index
    # the residuals the down blocks leave for the up blocks: most bytes in the middle of the UNet
    assert crossing[3] > crossing[0] and crossing[3] > crossing[-1]


def test_a_unet_that_fits_no_node_asks_for_the_cut(checkpoint: Path) -> None:
    weights = part_bytes(checkpoint)
    act = placing.activation_bytes(16)
    room = int(weights["unet"] * placing.WEIGHT_HEADROOM) + act - 1
    nodes = [placing.NodeRoom(f"n{i}", f"10.0.0.{i}", room) for i in range(3)]
    with pytest.raises(placing.CutNeeded) as caught:
        placing.place(nodes, weights, 16)
    assert caught.value.needs["act"] == act and caught.value.needs["unet"] > room


def _node(name: str, speed: float, capacity: int, units: int = 7) -> NodeCosts:
    """A node ``speed`` times slower than the reference: each unit 1 s × speed, text and vae 0.1 s × speed."""
    return NodeCosts(name, name, capacity, 0.1 * speed, 0.1 * speed, [speed] * units, [0.0] * 6, [0.0] * 6)


NEEDS = {"text": 1 * MIB, "vae": 1 * MIB, "act": 1 * MIB}
UNITS = [1 * MIB] * 7


def test_the_cut_gives_a_faster_node_more_units() -> None:
    nodes = [_node("fast", 1.0, 100 * MIB), _node("slow", 4.0, 100 * MIB)]
    plan = search(nodes, UNITS, [0] * 6, NEEDS, steps=1, headroom=1.0)
    held = {n: b - a for n, a, b in plan.stages}
    assert held.get("fast", 0) > held.get("slow", 0)
    assert plan.busy_s["fast"] <= 7.2


def test_memory_forces_the_cut_and_is_never_exceeded() -> None:
    # 7 MiB of units, 1 MiB activations a stage: no node of 5 MiB holds them, three do when cut
    nodes = [_node(f"n{i}", 1.0, 5 * MIB) for i in range(3)]
    plan = search(nodes, UNITS, [0] * 6, NEEDS, steps=1, headroom=1.0)
    assert len(plan.stages) >= 2
    assert all(plan.memory[n] <= 5 * MIB for n in plan.memory)
    with pytest.raises(ValueError, match=r"no cut of the UNet by blocks fits the nodes' memory \(nodes: n0 2 MiB"):
        search([_node(f"n{i}", 1.0, 2 * MIB) for i in range(3)], UNITS, [0] * 6, NEEDS, steps=1, headroom=1.0)


def _cut_points(plan) -> list[int]:  # type: ignore[no-untyped-def]
    return [b for _, _, b in plan.stages][:-1]


def test_the_carry_is_charged_in_memory_and_in_time() -> None:
    nodes = [_node("a", 1.0, 6 * MIB), _node("b", 1.0, 6 * MIB)]
    free = search(nodes, UNITS, [0] * 6, NEEDS, steps=1, headroom=1.0)
    (cut,) = _cut_points(free)
    # the carry at that cut made 3 MiB: the stages on either side no longer fit there, the cut moves
    crossing = [0] * 6
    crossing[cut - 1] = 3 * MIB
    moved = search(nodes, UNITS, crossing, NEEDS, steps=1, headroom=1.0)
    assert _cut_points(moved) != [cut] and all(m <= 6 * MIB for m in moved.memory.values())
    # the same in time: serialising the carry at that cut costs 2 s on each side, so the cut moves
    costly = [0.0] * 6
    costly[cut - 1] = 2.0
    slow = [NodeCosts(n, n, 100 * MIB, 0.1, 0.1, [1.0] * 7, costly, costly) for n in "ab"]
    assert _cut_points(search(slow, UNITS, [0] * 6, NEEDS, steps=1, headroom=1.0)) != [cut]
    assert _cut_points(search(slow, UNITS, [0] * 6, NEEDS, steps=3, headroom=1.0)) != [cut]
