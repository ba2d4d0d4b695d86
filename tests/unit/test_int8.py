"""int8 weights on CPU stages (``serve --quantize int8``): each row's numbers its own, products close to the
float ones, the weights' bytes dropped, and a whole stage's greedy tokens mostly those of bfloat16."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from raycluster_cli.models import int8  # noqa: E402
from raycluster_cli.models.batched import BatchedStage  # noqa: E402
from raycluster_cli.models.config import ModelConfig  # noqa: E402

pytestmark = pytest.mark.skipif(not int8.available(), reason="this torch has no fbgemm int8 kernels")


def _linear(rows: int, cols: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(cols, rows, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
    return linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_product_is_its_own_whatever_shares_its_step(dtype: torch.dtype) -> None:
    """fbgemm quantizes its whole input with one scale: a row of large values beside it would change another
    row's numbers.  Each row scaled on its own gives the same numbers alone as beside any other rows."""
    linear = _linear(96, 64, True, 0)
    x = torch.randn(5, 64).to(dtype)
    want = linear(x.float())
    mm = int8.Int8Matmuls([linear])
    assert linear.weight.numel() == 0 and mm.weight_bytes == 96 * 64  # the float weights are gone
    with torch.inference_mode():
        alone = torch.cat([mm.apply(linear, x[i : i + 1]) for i in range(5)])
        loud = x.clone()
        loud[4] *= 1000
        beside = mm.apply(linear, loud)
        together = mm.apply(linear, x)
    assert together.dtype == dtype and together.shape == (5, 96)
    assert torch.equal(alone[:4], beside[:4]) and torch.equal(alone, together)
    error = (together.float() - want).abs().max() / want.abs().max()
    assert error < 0.03, error  # int8's rounding; bfloat16 alone is ~0.004


def test_any_leading_shape_and_a_row_of_zeros() -> None:
    linear = _linear(32, 48, False, 1)
    x = torch.randn(2, 3, 48)
    x[1, 2] = 0
    with torch.no_grad():
        want = linear(x)
    mm = int8.Int8Matmuls([linear])
    with torch.inference_mode():
        got = mm.apply(linear, x)
    assert got.shape == (2, 3, 32) and not got[1, 2].any()
    torch.testing.assert_close(got, want, rtol=0, atol=0.03 * float(want.abs().max()))


def test_a_stage_with_int8_weights_decodes_mostly_the_tokens_of_bfloat16() -> None:
    """A Qwen2-like stage (biases on q/k/v, grouped-query attention) teacher-forced over 4 prompts of 24 tokens:
    int8's next-token choice is bfloat16's for at least 90 % of positions (random weights: no outliers, which
    real checkpoints have; docs/PERFORMANCE.md E7 measures the real shape), and its stage holds under half the
    weight bytes."""
    cfg = ModelConfig(
        vocab=512, d_model=128, heads=4, kv_heads=2, ffn=384, layers=3, max_seq=64, arch="llama",
        activation="silu", qkv_bias=True, seed=5, dtype="bfloat16",
    )  # fmt: skip
    ids = torch.randint(0, cfg.vocab, (4, 24), generator=torch.Generator().manual_seed(2))
    table = torch.tensor([[0, 1, 2, 3], [0] * 4, [24] * 4, [1] * 4])  # every position's logits
    picks, held = {}, {}
    for quantize in ("", "int8"):
        stage = BatchedStage(replace(cfg, quantize=quantize), 0, cfg.num_units, 4, measure_matmuls=False)
        picks[quantize] = stage.forward(ids, table).argmax(-1)
        held[quantize] = sum(p.numel() * p.element_size() for p in stage.stage.parameters())
    assert held["int8"] < 0.5 * held[""]
    agree = (picks[""] == picks["int8"]).float().mean()
    assert agree >= 0.9, agree


def test_quantize_is_one_of_its_words() -> None:
    with pytest.raises(ValueError, match="quantize must be one of"):
        ModelConfig(quantize="int4")
