"""A decode row's attention on a CPU as two float32 products: the same values as torch's attention kernel."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from raycluster_cli.models.config import ModelConfig  # noqa: E402
from raycluster_cli.models.rows import Rows, SlotCache, UniformRows, decode_attention  # noqa: E402


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (14, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_query_against_its_keys_equals_the_kernel_with_grouped_heads(
    heads: int, kv_heads: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(heads + kv_heads)
    q = torch.randn(3, heads, 1, 16)
    k, v = torch.randn(3, kv_heads, 37, 16), torch.randn(3, kv_heads, 37, 16)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=kv_heads != heads)  # float32: the reference
    got = decode_attention(q.to(dtype), k.to(dtype), v.to(dtype))
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16: its inputs' and output's rounding
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_service_rows_and_bench_rows_use_it_for_decodes_and_keep_prompt_chunks_masked() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab=8, d_model=32, heads=4, kv_heads=2, layers=1, max_seq=24, arch="llama", activation="silu")
    cache = SlotCache(3, cfg, torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape))
    cache.v.copy_(torch.randn(cache.v.shape))
    # a decode row at position 9 in slot 2 beside a prompt chunk of 3 tokens at 4..6 in slot 0
    rows = Rows.from_table(torch.tensor([[2, 0], [9, 4], [1, 3]]), 3)
    q = torch.randn(2, 4, 3, 8)
    got = rows.by_row(q, cache, gqa=True)
    gathered = rows.gathered(q, cache, gqa=True)  # its padding queries attend too: compare the real ones
    torch.testing.assert_close(got[0, :, :1], gathered[0, :, :1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], gathered[1], rtol=1e-5, atol=1e-5)
    decode = F.scaled_dot_product_attention(q[:1, :, :1], cache.k[2:3, :, :10], cache.v[2:3, :, :10], enable_gqa=True)
    torch.testing.assert_close(got[:1, :, :1], decode, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(got[0, :, 1:]) == 0  # the decode row's padding stays zeros
    uniform = UniformRows.of(3, 5, 1, torch.device("cpu"))
    qu = torch.randn(3, 4, 1, 8)
    want = F.scaled_dot_product_attention(qu, cache.k[:, :, :6], cache.v[:, :, :6], enable_gqa=True)
    torch.testing.assert_close(uniform.attend(qu, cache, gqa=True), want, rtol=1e-5, atol=1e-5)
