"""The sharded model must compute exactly what the whole model computes."""

from __future__ import annotations

import pytest
import torch

from raycluster_cli.models.decoder import (
    ModelConfig,
    Stage,
    full_model_stage,
    greedy_generate,
    prefill_chunks,
    unit_seed,
)
from raycluster_cli.placement.partition import even_partition, manual_partition

CFG = ModelConfig(vocab=97, d_model=32, heads=4, layers=6, max_seq=24, seed=3)
PARTITIONS = [
    [(0, 8)],
    even_partition(6, 2),
    even_partition(6, 3),
    manual_partition([1, 4, 1]),
    [(0, 1), (1, 7), (7, 8)],  # embedding alone, head alone
    even_partition(6, 6),
]


def _prompts(batch: int = 3, length: int = 5, seed: int = 11) -> torch.Tensor:
    return torch.randint(0, CFG.vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _chain(stages: list[Stage], x: torch.Tensor, cache_id: int, position: int) -> torch.Tensor:
    for stage in stages:
        x = stage(x, cache_id, position)
    return x


@pytest.mark.parametrize("ranges", PARTITIONS, ids=str)
def test_chained_stages_match_full_model_logits_with_kv_cache(ranges: list[tuple[int, int]]) -> None:
    full = full_model_stage(CFG, emit="logits")
    stages = [Stage(CFG, a, b, emit="logits") for a, b in ranges]
    prompts = _prompts()
    ref = full(prompts, 0, 0)
    got = _chain(stages, prompts, 0, 0)
    assert ref.shape == (3, 5, CFG.vocab)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    position = prompts.shape[1]
    for _ in range(4):  # decode steps feed back the greedy token
        nxt = ref[:, -1].argmax(-1)[:, None]
        ref = full(nxt, 0, position)
        got = _chain(stages, nxt, 0, position)
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
        position += 1


@pytest.mark.parametrize("ranges", PARTITIONS, ids=str)
def test_greedy_tokens_identical_through_stages(ranges: list[tuple[int, int]]) -> None:
    prompts = _prompts(batch=2, length=6)
    ref = greedy_generate([full_model_stage(CFG)], prompts, 8)
    got = greedy_generate([Stage(CFG, a, b) for a, b in ranges], prompts, 8)
    assert ref.shape == (2, 8)
    assert torch.equal(got, ref)


def test_prefill_chunks() -> None:
    assert prefill_chunks(32) == [(0, 32)]
    assert prefill_chunks(32, 8) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert prefill_chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert prefill_chunks(3, 8) == [(0, 3)]
    with pytest.raises(ValueError, match=">= 0"):
        prefill_chunks(8, -1)


@pytest.mark.parametrize("chunk", [1, 2, 4])
def test_chunked_prefill_gives_the_whole_prompt_logits_and_tokens(chunk: int) -> None:
    model = full_model_stage(CFG, emit="logits")
    prompts = _prompts(batch=2, length=6)
    whole = model(prompts, "whole", 0)
    pieces = [model(prompts[:, a:b], "chunked", a) for a, b in prefill_chunks(6, chunk)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-5, atol=1e-5)
    ref = greedy_generate([full_model_stage(CFG)], prompts, 6, prefill_chunk=chunk)
    sharded = greedy_generate([Stage(CFG, a, b) for a, b in even_partition(6, 3)], prompts, 6, prefill_chunk=chunk)
    assert torch.equal(sharded, ref)
    assert torch.equal(ref, greedy_generate([full_model_stage(CFG)], prompts, 6))  # same tokens as one prefill


def test_kv_cache_decode_matches_recomputing_whole_sequence() -> None:
    """Decode with the cache must equal a fresh prefill over prompt + generated tokens."""
    model = full_model_stage(CFG, emit="logits")
    prompts = _prompts(batch=2, length=4)
    logits = model(prompts, "a", 0)
    seq = prompts
    for step in range(3):
        nxt = logits[:, -1].argmax(-1)[:, None]
        seq = torch.cat([seq, nxt], dim=1)
        logits = model(nxt, "a", 4 + step)
        fresh = model(seq, "b", 0)[:, -1:]
        torch.testing.assert_close(logits, fresh, rtol=1e-5, atol=1e-5)


def test_weights_depend_only_on_seed_and_unit() -> None:
    full = full_model_stage(CFG)
    part = Stage(CFG, 3, 5)
    assert torch.equal(part.blocks[0].qkv.weight, full.blocks[2].qkv.weight)
    assert torch.equal(part.blocks[1].fc2.bias, full.blocks[3].fc2.bias)
    assert not torch.equal(full.blocks[0].qkv.weight, full.blocks[1].qkv.weight)
    deeper = Stage(ModelConfig(vocab=97, d_model=32, heads=4, layers=9, max_seq=24, seed=3), 3, 4)
    assert torch.equal(deeper.blocks[0].qkv.weight, full.blocks[2].qkv.weight)
    other_seed = Stage(ModelConfig(vocab=97, d_model=32, heads=4, layers=6, max_seq=24, seed=4), 3, 4)
    assert not torch.equal(other_seed.blocks[0].qkv.weight, full.blocks[2].qkv.weight)
    assert unit_seed(0, 1) == unit_seed(0, 1) != unit_seed(1, 0)


def test_stage_flags_and_outputs() -> None:
    first, last = Stage(CFG, 0, 3), Stage(CFG, 3, 8)
    assert first.has_embedding and not first.has_head and first.num_blocks == 2
    assert last.has_head and not last.has_embedding and last.num_blocks == 4
    hidden = first(_prompts(), 7, 0)
    assert hidden.shape == (3, 5, CFG.d_model) and hidden.dtype == torch.float32
    tokens = last(hidden, 7, 0)
    assert tokens.shape == (3,) and tokens.dtype == torch.long
    assert first.cached_ids() == [7]
    assert first.release(7) and not first.release(7)


def test_stage_errors() -> None:
    with pytest.raises(ValueError, match="unit range"):
        Stage(CFG, 3, 3)
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=30, heads=4)
    stage = Stage(CFG, 0, 3)
    with pytest.raises(KeyError, match="decode before prefill"):
        stage(_prompts(length=1), "x", 5)
    stage(_prompts(), "x", 0)
    with pytest.raises(ValueError, match="cached tokens"):
        stage(_prompts(length=1), "x", 7)
    with pytest.raises(ValueError, match="max_seq"):
        stage(_prompts(length=1), "y", CFG.max_seq)
    with pytest.raises(ValueError, match="hidden states"):
        Stage(CFG, 1, 3)(_prompts(), "z", 0)
