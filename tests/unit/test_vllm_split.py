"""vLLM's pipeline settings from measured nodes: layers follow speed, every stage holds the same KV positions for
each of its layers within one memory fraction, the tight stage bounds the KV room, mixed GPU counts are refused."""

from __future__ import annotations

import math

import pytest

from raycluster_cli.models.config import ModelConfig
from raycluster_cli.placement.memory import unit_bytes
from raycluster_cli.placement.partition import DoesNotFit
from raycluster_cli.placement.pipelines import NodeSpeed
from raycluster_cli.placement.vllm_split import (
    MOST_UTILIZATION,
    MixedGpuCounts,
    VllmNode,
    best_pipeline,
    group_by_gpus,
    kv_room,
    utilization,
    vllm_even_layers,
    vllm_split,
)

CFG = ModelConfig(
    arch="llama", activation="silu", vocab=1000, d_model=256, heads=4, kv_heads=2, ffn=512, layers=12, max_seq=512
)
GB = 10**9


def node(ip: str, block_s: float, total: float = 16, free: float = 12, gpus: int = 0) -> VllmNode:
    costs = (block_s / 4, *([block_s] * CFG.layers), block_s * 2)
    return VllmNode(NodeSpeed(f"id-{ip}", ip, costs), int(total * GB), int(free * GB), gpus)


def test_layers_follow_speed_and_beat_the_even_split() -> None:
    nodes = [node("10.0.0.9", 1.0), node("10.0.0.10", 2.0), node("10.0.0.11", 4.0)]
    split = vllm_split(CFG, nodes, kv_tokens=4096)
    assert sum(split.layers) == CFG.layers
    assert split.layers[0] > split.layers[1] > split.layers[2]
    assert split.env() == {"VLLM_PP_LAYER_PARTITION": ",".join(map(str, split.layers))}
    assert split.ips == ("10.0.0.9", "10.0.0.10", "10.0.0.11")  # the order asked for, not the IPs' text order
    assert max(split.stage_s) < 0.7 * max(split.even_stage_s)
    assert "--pipeline-parallel-size=3" in split.flags() and "--tensor-parallel-size=1" in split.flags()
    assert split.utilization == 0.75 and split.kv_tokens >= 4096


def test_stage_order_is_the_node_order() -> None:
    fast, slow = node("a", 1.0), node("b", 3.0)
    fast_first, slow_first = vllm_split(CFG, [fast, slow], 1024), vllm_split(CFG, [slow, fast], 1024)
    assert fast_first.ips == ("a", "b") and fast_first.layers[0] > fast_first.layers[1]
    assert slow_first.ips == ("b", "a") and slow_first.layers[0] < slow_first.layers[1]


def test_the_tight_stage_bounds_every_rank_s_kv_blocks() -> None:
    """A fast node with little memory: it takes only the layers whose KV it can hold, and its room, not the big
    node's, sets the blocks every rank gets (vLLM takes the smallest rank's count)."""
    kv_tokens = 200_000  # 2 * 2 heads * 64 * 4 bytes = 1 KiB a position a layer: ~0.2 GB a layer
    small_fast = node("fast", 1.0, total=1.0, free=0.9)
    big_slow = node("slow", 1.5, total=8.0, free=7.2)
    split = vllm_split(CFG, [small_fast, big_slow], kv_tokens=kv_tokens)
    unconstrained = vllm_split(CFG, [node("fast", 1.0), node("slow", 1.5)], kv_tokens=kv_tokens)
    assert split.layers[0] < unconstrained.layers[0]
    rooms = [split.utilization * n.total for n in (small_fast, big_slow)]
    weights = unit_bytes(CFG)
    per_block = CFG.kv_bytes(split.block_size)
    first = split.layers[0] + 1  # units 0..layers[0]: the embedding and stage 0's layers
    held = [sum(weights[:first]), sum(weights[first:])]
    expected = [math.floor((r - w) / (n * per_block)) for r, w, n in zip(rooms, held, split.layers, strict=True)]
    assert split.kv_blocks == min(expected) and split.bound_by == expected.index(min(expected))
    assert split.kv_tokens >= kv_tokens
    assert split.stage_kv_bytes[0] == split.layers[0] * CFG.kv_bytes(split.kv_tokens)


def test_kv_room_counts_each_stage_s_own_layers() -> None:
    ranges = [(0, 4), (4, 14)]  # 3 layers + embedding, 9 layers + head
    blocks, bound = kv_room(CFG, ranges, [4 * GB, 4 * GB], 16)
    assert bound == 1  # same room, three times the layers
    assert blocks == math.floor((4 * GB - sum(unit_bytes(CFG)[4:14])) / (9 * CFG.kv_bytes(16)))


def test_too_much_kv_is_refused_with_the_numbers_and_the_fix() -> None:
    with pytest.raises(DoesNotFit, match=r"fewer sequences at once.*--dtype bfloat16"):
        vllm_split(CFG, [node("a", 1.0, total=1, free=0.5), node("b", 1.0, total=1, free=0.5)], kv_tokens=10**7)


def test_mixed_gpu_counts_are_refused_naming_the_nodes_and_the_fix() -> None:
    with pytest.raises(MixedGpuCounts, match=r"10.0.0.1 2 GPU\(s\), 10.0.0.2 1 GPU\(s\).*--engine ours"):
        vllm_split(CFG, [node("10.0.0.1", 1.0, gpus=2), node("10.0.0.2", 1.0, gpus=1)], kv_tokens=512)
    split = vllm_split(CFG, [node("g1", 1.0, gpus=2), node("g2", 2.0, gpus=2)], kv_tokens=512)
    assert split.tensor_parallel == 2


def test_group_by_gpus_keeps_the_order_within_a_count() -> None:
    nodes = [node("a", 1, gpus=1), node("b", 1, gpus=2), node("c", 1, gpus=1), node("d", 1, gpus=2)]
    assert [[n.speed.ip for n in g] for g in group_by_gpus(nodes)] == [["b", "d"], ["a", "c"]]


def test_one_utilization_the_fullest_node_sets() -> None:
    assert utilization([node("a", 1, total=10, free=9.99), node("b", 1, total=80, free=41)]) == 0.51
    assert utilization([node("a", 1, total=10, free=10)]) == MOST_UTILIZATION
    with pytest.raises(ValueError, match="total memory"):
        utilization([node("a", 1, total=0, free=0)])


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match="kv_tokens"):
        vllm_split(CFG, [node("a", 1.0)], kv_tokens=0)
    with pytest.raises(ValueError, match="at least one node"):
        vllm_split(CFG, [], kv_tokens=16)


def test_vllm_s_own_split_puts_the_remainder_before_the_last_stage() -> None:
    assert vllm_even_layers(24, 3) == [8, 8, 8]
    assert vllm_even_layers(4, 3) == [1, 2, 1]
    assert vllm_even_layers(26, 4) == [6, 7, 7, 6]


def test_best_pipeline_takes_the_fastest_nodes_in_the_order_whose_slowest_stage_is_fastest() -> None:
    nodes = [node("slow", 4.0), node("fast", 1.0), node("mid", 2.0)]
    best = best_pipeline(CFG, nodes, 2, kv_tokens=1024)
    assert set(best.ips) == {"fast", "mid"}
    others = [vllm_split(CFG, [nodes[1], nodes[2]], 1024), vllm_split(CFG, [nodes[2], nodes[1]], 1024)]
    assert max(best.stage_s) == min(max(s.stage_s) for s in others)
    with pytest.raises(ValueError, match="--stages 4"):
        best_pipeline(CFG, nodes, 4, kv_tokens=1024)
