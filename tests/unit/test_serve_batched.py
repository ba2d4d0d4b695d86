"""The batched stage forward (rows at different positions, own KV slots) equals the bench's one-sequence Stage."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from raycluster_cli.models.batched import BatchedStage  # noqa: E402
from raycluster_cli.models.decoder import ModelConfig, Stage, config_from_checkpoint  # noqa: E402

from ..llama_checkpoint import GQA, write_llama  # noqa: E402

GPT2 = ModelConfig(vocab=61, d_model=32, heads=4, layers=3, max_seq=40, seed=3)


@pytest.fixture(scope="module")
def llama_cfg(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    shape: dict[str, Any] = GQA
    path = write_llama(tmp_path_factory.mktemp("llama") / "ckpt", **shape)
    return config_from_checkpoint(path, max_seq=40)


def _reference(cfg: ModelConfig, prompt: Any, pieces: list[int]) -> list[Any]:
    """Logits of the last token of each piece, through the bench's own full-model Stage, one sequence alone."""
    stage = Stage(cfg, 0, cfg.num_units, emit="logits")
    out, start = [], 0
    for n in pieces:
        out.append(stage(prompt[None, start : start + n], "ref", start)[0, -1])
        start += n
    return out


def _table(rows: list[tuple[int, int, int]]) -> Any:
    return torch.tensor(rows, dtype=torch.long).T.contiguous()


def _pad(pieces: list[Any]) -> Any:
    width = max(len(p) for p in pieces)
    return torch.stack([torch.cat([p, p.new_zeros(width - len(p))]) for p in pieces])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_mixed_rows_equal_one_sequence_at_a_time(arch: str, llama_cfg: ModelConfig) -> None:
    cfg = GPT2 if arch == "gpt2" else llama_cfg
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(0, cfg.vocab, (n,), generator=gen) for n in (9, 4, 12))
    # two stages, as the pipeline cuts the model; slots in an order unlike the rows'
    half = 1 + cfg.layers // 2
    stages = [BatchedStage(cfg, 0, half, slots=4), BatchedStage(cfg, half, cfg.num_units, slots=4)]

    def step(rows: list[tuple[int, int, int]], pieces: list[Any]) -> Any:
        x = _pad(pieces)
        for stage in stages:
            x = stage.forward(x, _table(rows))
        return x

    # step 1: a's whole prompt (slot 2) next to b's first chunk (slot 0)
    first = step([(2, 0, 9), (0, 0, 2)], [a, b[:2]])
    # step 2: a decodes one token, b's second chunk, c's first chunk (slot 3)
    second = step([(2, 9, 1), (0, 2, 2), (3, 0, 5)], [c[:1], b[2:], c[:5]])
    # step 3: c's rest alone
    third = step([(3, 5, 7)], [c[5:]])
    want_a = _reference(cfg, torch.cat([a, c[:1]]), [9, 1])
    want_b = _reference(cfg, b, [2, 2])
    want_c = _reference(cfg, c, [5, 7])
    got = {"a": [first[0], second[0]], "b": [first[1], second[1]], "c": [second[2], third[0]]}
    for name, want in (("a", want_a), ("b", want_b), ("c", want_c)):
        for g, w in zip(got[name], want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=name)
            assert int(g.argmax()) == int(w.argmax())


def _sampled_table(rows: list[tuple[int, int, int]], sampling: list[Any]) -> Any:
    from raycluster_cli.models.sampling import Params

    flags = torch.zeros(1, len(rows), dtype=torch.long)  # no row wants every position's logits
    return torch.cat([_table(rows), flags, Params.of(sampling).table()])


@pytest.mark.parametrize("packed", [True, False])
def test_a_prompt_chunk_that_samples_nothing_gets_no_logits(
    packed: bool, llama_cfg: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row in ``MODE_SKIP`` (a prompt's chunk before its last) costs no head product: a step of them only runs no
    head at all, and beside sampled rows theirs are left out; the sampled rows' tokens are the same either way."""
    from raycluster_cli.models import rows as rows_module
    from raycluster_cli.models.sampling import MODE_SKIP, RowSampling

    if not packed:  # the padded path (a GPU's), taken on this CPU
        monkeypatch.setattr(rows_module.PackedRows, "from_table", rows_module.Rows.from_table)
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randint(0, llama_cfg.vocab, (n,), generator=gen) for n in (12, 6))
    skip, greedy = RowSampling(mode=MODE_SKIP), RowSampling(position=6)
    drawn = RowSampling(temperature=0.8, top_p=0.9, seed=7, position=8)

    def run(skipping: bool) -> tuple[Any, list[int]]:
        stage = BatchedStage(llama_cfg, 0, llama_cfg.num_units, slots=4)
        heads: list[int] = []
        head = stage.stage.head
        assert head is not None
        head.register_forward_hook(lambda _m, args, _o: heads.append(int(args[0].shape[0])))
        first = skip if skipping else RowSampling(position=4)
        # a's first chunk alone, then its second beside b's whole prompt and a second look at a
        alone = stage.forward(a[None, :4], _sampled_table([(0, 0, 4)], [first]))
        both = stage.forward(
            _pad([a[4:8], b]), _sampled_table([(0, 4, 4), (1, 0, 6)], [skip if skipping else drawn, greedy])
        )
        last = stage.forward(a[None, 8:], _sampled_table([(0, 8, 4)], [drawn]))
        return torch.cat([alone, both, last]), heads

    skipped, heads = run(True)
    every, heads_every = run(False)
    assert heads_every == [1, 2, 1]
    assert heads == [1, 1]  # no head for the step of a skipped row alone; one row of logits beside b
    assert skipped.tolist()[:2] == [0, 0]  # a skipped row's token: 0, never read
    assert skipped[2:].tolist() == [every[2].item(), every[3].item()]  # b's and a's last tokens unchanged


def test_rejects_a_slot_out_of_range() -> None:
    stage = BatchedStage(GPT2, 0, GPT2.num_units, slots=2)
    with pytest.raises(ValueError, match="slot out of range"):
        stage.forward(torch.zeros(1, 1, dtype=torch.long), _table([(2, 0, 1)]))


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_by_row_equals_the_gathered_masked_attention(window: int, kv_heads: int) -> None:
    """The CPU's row-by-row attention on views of each slot gives the GPU's gathered, masked attention's
    values on every real position: decode rows, prompt chunks at a start past 0, padding, windows, GQA."""
    from raycluster_cli.models.batched import Rows, SlotCache

    cfg = ModelConfig(
        vocab=61, d_model=32, heads=4, kv_heads=kv_heads, layers=1, max_seq=40, arch="llama", activation="silu", seed=3
    )
    cache = SlotCache(5, cfg, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    # slot, start, length: two decode rows (one past the window's reach), a chunk at 6, a prompt's first chunk
    rows = Rows.from_table(_table([(3, 17, 1), (0, 2, 1), (4, 6, 5), (1, 0, 3)]), width=5)
    q = torch.randn(4, cfg.heads, 5, cfg.dim_per_head, generator=gen)
    gqa = kv_heads != cfg.heads
    got, want = rows.by_row(q, cache, window, gqa), rows.gathered(q, cache, window, gqa)
    valid = rows.valid[:, None, :, None].expand_as(want)
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-5)
    assert not got[~valid].any()  # padding: zeros
