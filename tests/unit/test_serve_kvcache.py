"""K/V taken by blocks of a pool as sequences grow: the stage's memory follows the tokens, the paged attention
gives the reserved cache's values, and the engine's preemption by recompute leaves every greedy answer as it is
alone (real torch, the engine over in-process stages)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from raycluster_cli.models.batched import BatchedStage  # noqa: E402
from raycluster_cli.models.decoder import ModelConfig, Stage, config_from_checkpoint  # noqa: E402
from raycluster_cli.models.kvcache import BlockTable, PagedCache  # noqa: E402
from raycluster_cli.models.rows import PackedRows, Rows, SlotCache  # noqa: E402
from raycluster_cli.serve.engine import Engine  # noqa: E402
from raycluster_cli.serve.scheduler import Limits  # noqa: E402
from raycluster_cli.serve.text import Sampling  # noqa: E402

from ..serve_checkpoint import write_chat_llama  # noqa: E402
from .test_serve_engine import _alone, _InProcessStage  # noqa: E402

CFG = ModelConfig(
    vocab=61, d_model=32, heads=4, kv_heads=2, layers=2, max_seq=200, arch="llama", activation="silu", seed=3
)


def _table(rows: list[tuple[int, int, int]]) -> Any:
    return torch.tensor(rows, dtype=torch.long).T.contiguous()


def test_a_slots_storage_grows_by_blocks_and_is_released_when_its_sequence_ends() -> None:
    """A 10-token prompt holds one block of 16; decoding past 16 takes a second, the logits still the one-sequence
    Stage's; the engine's release gives the memory back, a late one (a newer sequence began) does not."""
    stage = BatchedStage(CFG, 0, CFG.num_units, slots=4, kv_block=16, measure_matmuls=False)
    reference = Stage(CFG, 0, CFG.num_units, emit="logits")
    prompt = torch.randint(0, CFG.vocab, (1, 10), generator=torch.Generator().manual_seed(0))
    got = stage.forward(prompt, _table([(2, 0, 10)]))
    want = reference(prompt, "m", 0)[:, -1]
    assert stage.held_tokens == 16 and stage.table.capacity(2) == 16
    for position in range(10, 20):
        token = got.argmax(-1, keepdim=True)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        got = stage.forward(token, _table([(2, position, 1)]))
        want = reference(token, "m", position)[:, -1]
    assert stage.held_tokens == 32  # two blocks: grown once, at position 16
    held = sum(c.held_bytes for c in stage.caches)
    assert held == 2 * 2 * 32 * CFG.num_kv_heads * CFG.dim_per_head * 4  # layers x K,V x 32 positions, float32
    stage.release([(2, 0)])  # sent for a sequence before this one: this one's K/V stays
    assert stage.held_tokens == 32
    stage.release([(2, 1)])
    assert stage.held_tokens == 0 and sum(c.held_bytes for c in stage.caches) == 0


def test_a_new_sequence_in_a_slot_drops_what_the_last_one_left() -> None:
    stage = BatchedStage(CFG, 0, CFG.num_units, slots=2, kv_block=16, measure_matmuls=False)
    stage.forward(torch.zeros(1, 40, dtype=torch.long), _table([(0, 0, 40)]))
    assert stage.held_tokens == 48
    stage.forward(torch.zeros(1, 3, dtype=torch.long), _table([(0, 0, 3)]))
    assert stage.held_tokens == 16 and stage.begun == [2, 0]


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_storage_attends_as_the_reserved_cache_does(window: int, dtype: str) -> None:
    """The same K/V written into a reserved cache and into pools by blocks (a slot's blocks not in order, after
    another slot's release): the paged attention gives the reserved cache's values on every real position, for
    decode rows together, beside a chunk past 0 and a prompt's first chunk, and for decode rows alone."""
    cfg = replace(CFG, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    table = BlockTable(5, 64, torch.device("cpu"), block=8)
    reserved, paged = SlotCache(5, cfg, torch.device("cpu")), PagedCache(table, cfg, torch.device("cpu"))

    def write(listed: list[tuple[int, int, int]], width: int) -> Rows:
        rows = Rows.from_table(_table(listed), width=width)
        k, v = (torch.randn(len(listed), cfg.num_kv_heads, width, cfg.dim_per_head, generator=gen) for _ in range(2))
        table.prepare(rows)
        for cache in (reserved, paged):
            rows.write(cache, k.to(getattr(torch, dtype)), v.to(getattr(torch, dtype)))
        return rows

    write([(2, 0, 16), (1, 0, 8)], 16)
    table.release(2)  # its two blocks go back: slot 3's three are blocks 0, 1 and 3, around slot 1's
    write([(3, 0, 18), (0, 0, 3), (4, 0, 6)], 18)
    assert table.held[3] == [0, 1, 3] and table.held[1] == [2]
    assert [table.capacity(s) for s in range(5)] == [8, 8, 0, 24, 8] and table.held_tokens == 48
    tolerance = {"float32": 1e-5, "bfloat16": 2e-2}[dtype]
    for listed, width in (([(3, 18, 1), (0, 3, 1), (4, 6, 5), (1, 0, 3)], 5), ([(3, 19, 1), (0, 4, 1)], 1)):
        rows = write(listed, width)
        q = torch.randn(len(listed), cfg.heads, width, cfg.dim_per_head, generator=gen).to(getattr(torch, dtype))
        want = rows.gathered(q, reserved, window, True).float()
        valid = rows.valid[:, None, :, None].expand_as(want)
        got = rows.attend(q, paged, window, True).float()
        torch.testing.assert_close(got[valid], want[valid], rtol=tolerance, atol=tolerance)
        assert not got[~valid].any()  # the padding comes out as zeros


def test_the_pools_grow_when_more_blocks_are_asked_for_than_the_budget() -> None:
    """A release that arrives after the next sequence began: the pools take a quarter more blocks and keep
    what they held."""
    table = BlockTable(3, 16, torch.device("cpu"), block=8)
    cache = PagedCache(table, CFG, torch.device("cpu"))
    rows = Rows.from_table(_table([(0, 0, 16)]), width=16)
    k = torch.randn(1, CFG.num_kv_heads, 16, CFG.dim_per_head)
    table.prepare(rows)
    cache.write(rows, k, k)
    more = Rows.from_table(_table([(1, 0, 9)]), width=9)
    table.prepare(more)
    cache.write(more, k[:, :, :9], k[:, :, :9])
    assert table.count == 4 and cache.k.shape[1] == 32 and table.held_tokens == 32
    kept, _ = cache.keys(0, 0, 16)
    torch.testing.assert_close(kept[0], k[0])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_llama(tmp_path_factory.mktemp("kv") / "ckpt")


def test_preemption_by_recompute_leaves_greedy_answers_as_alone_and_sends_each_token_once(checkpoint: Path) -> None:
    """Three requests that grow to ~30 tokens each in a budget of 64: the engine preempts (frees the stages' K/V,
    prefills again), and each answer is its greedy answer alone; each output adds one token to what was sent."""
    prompts = [[5, 6, 7, 8, 9, 10], [12, 13, 14], [20, 21, 22, 23]]
    cfg = config_from_checkpoint(checkpoint, max_seq=64)
    stages_held: list[BatchedStage] = []

    async def run() -> tuple[list[list[int]], list[list[int]], int]:
        half = 1 + cfg.layers // 2
        stages = [BatchedStage(cfg, a, b, 3, kv_block=8) for a, b in ((0, half), (half, cfg.num_units))]
        stages_held.extend(stages)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
        limits = Limits(slots=3, max_seq=64, prefill_chunk=4, kv_tokens=64, kv_block=8)
        engine = Engine([_InProcessStage(s) for s in stages], tokenizer, limits, frozenset())
        engine.start()

        async def one(prompt: list[int]) -> tuple[list[int], list[int]]:
            added, last = [], 0
            async for out in engine.generate(prompt, 24, Sampling(temperature=0, ignore_eos=True)):
                added.append(len(out.token_ids) - last)
                last = len(out.token_ids)
            return list(out.token_ids), added

        results = await asyncio.gather(*(one(p) for p in prompts))
        await asyncio.sleep(0.05)  # the last releases go out as the loop goes idle
        preemptions = engine.scheduler.preemptions
        await engine.close()
        return [r[0] for r in results], [r[1] for r in results], preemptions

    answers, added, preemptions = asyncio.run(run())
    assert preemptions >= 1
    assert all(a == [1] * 24 for a in added)  # each output sends exactly one new token
    for prompt, answer in zip(prompts, answers, strict=True):
        alone = asyncio.run(_alone(checkpoint, prompt, 24))
        assert answer == alone
    assert all(s.held_tokens == 0 for s in stages_held)  # every slot's K/V given back


def test_a_step_of_decodes_and_a_chunk_packs_them_with_each_rows_own_logits() -> None:
    """Three decode rows beside an 8-token chunk (packed: 11 tokens, not 32 positions): the step's logits, through
    a pipeline of two stages (padded hidden states between them), are each row's logits run alone."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, CFG.vocab, (1, n), generator=gen) for n in (5, 9, 3)]
    chunk = torch.randint(0, CFG.vocab, (1, 8), generator=gen)
    nexts = torch.randint(0, CFG.vocab, (3, 1), generator=gen)

    def pipeline() -> list[BatchedStage]:
        return [BatchedStage(CFG, a, b, 4, measure_matmuls=False) for a, b in ((0, 2), (2, CFG.num_units))]

    def run(stages: list[BatchedStage], x: Any, table: Any) -> Any:
        for stage in stages:
            x = stage.forward(x, table)
        return x

    together, alone = pipeline(), pipeline()
    for slot, prompt in enumerate(prompts):
        for stages in (together, alone):
            run(stages, prompt, _table([(slot, 0, prompt.shape[1])]))
    ids = torch.zeros(4, 8, dtype=torch.long)
    ids[:3, :1], ids[3] = nexts, chunk[0]
    got = run(together, ids, _table([(0, 5, 1), (1, 9, 1), (2, 3, 1), (3, 0, 8)]))
    want = [run(alone, nexts[i : i + 1], _table([(i, p.shape[1], 1)])) for i, p in enumerate(prompts)]
    want.append(run(alone, chunk, _table([(3, 0, 8)])))
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-4, atol=1e-4)


def test_packed_rows_pack_and_unpack_the_real_tokens_row_after_row() -> None:
    rows = PackedRows.from_table(_table([(0, 5, 1), (1, 0, 3), (2, 7, 2)]), 3)
    x = torch.arange(9 * 2, dtype=torch.float32).view(3, 3, 2)
    packed = rows.pack(x)
    assert packed.shape == (6, 2)
    torch.testing.assert_close(packed, torch.cat([x[0, :1], x[1, :3], x[2, :2]]))
    assert rows.firsts.tolist() == [0, 1, 4] and rows.lasts.tolist() == [0, 3, 5]
    back = rows.unpack(packed)
    assert back.shape == x.shape and bool((back[0, 1:] == 0).all()) and bool((back[2, 2:] == 0).all())
    torch.testing.assert_close(rows.pack(back), packed)
    whole = PackedRows.from_table(_table([(0, 0, 3), (1, 4, 3)]), 3)
    assert whole.real is None and whole.pack(x[:2]).shape == (6, 2)
