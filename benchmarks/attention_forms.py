"""What a decode step's attention costs a CPU stage in each of `models/rows.py`'s forms, one block.

Usage:  PYTHONPATH=. python benchmarks/attention_forms.py [--dtype float32|bfloat16] [--rows 1,2,4,8,16]
            [--context 120] [--heads 8] [--kv-heads 0] [--head-dim 64] [--repeats 200] [--out FILE]

For each row count B: B decode rows (one query each) in slots 0..B-1 of a 16-slot KV cache of one block, row i
at position `--context` + 7·i, one thread.  The median µs of `Rows.gathered` (every row's keys and values gathered
into one tensor, one masked attention: the GPU's form), of the gather alone, and of `Rows.by_row` (each row on
views of its own slot, no mask: the CPU's form, its one query as two float32 products, `decode_attention`), of
torch's attention kernel on the same views (`kernel_by_row`: the CPU's form before), and the largest difference
between the gathered and the by-row outputs.  Qwen2.5-0.5B's heads: `--heads 14 --kv-heads 2 --head-dim 64`.
Prints one JSON document (also to --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from raycluster_cli.models.batched import Rows, SlotCache
from raycluster_cli.models.config import ModelConfig


def _median_us(step: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        step()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples[5:]) * 1e6  # the first few: the libraries' set-up for the shape


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--context", type=int, default=120)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=0, help="key/value heads (grouped-query); 0: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    counts = [int(r) for r in args.rows.split(",")]
    cfg = ModelConfig(
        vocab=64, d_model=args.heads * args.head_dim, heads=args.heads, kv_heads=args.kv_heads, layers=1,
        arch="llama", activation="silu",
        max_seq=args.context + 7 * max(counts) + 1, dtype=args.dtype,
    )  # fmt: skip
    cache = SlotCache(max(16, max(counts)), cfg, torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape))
    cache.v.copy_(torch.randn(cache.v.shape))
    gqa = bool(args.kv_heads) and args.kv_heads != args.heads
    names = ("gathered", "gather_alone", "by_row", "kernel_by_row", "max_difference")
    table: dict[str, dict[str, float]] = {name: {} for name in names}

    def kernel_by_row(q: torch.Tensor, rows: Rows) -> list[torch.Tensor]:
        return [
            F.scaled_dot_product_attention(
                q[b : b + 1],
                cache.k[slot : slot + 1, :, : start + 1],
                cache.v[slot : slot + 1, :, : start + 1],
                enable_gqa=gqa,
            )
            for b, (slot, start, _) in enumerate(rows.listed)
        ]

    with torch.inference_mode():
        for count in counts:
            starts = args.context + 7 * torch.arange(count)
            rows = Rows.from_table(torch.stack([torch.arange(count), starts, torch.ones(count, dtype=torch.long)]), 1)
            q = torch.randn(count, args.heads, 1, args.head_dim).to(getattr(torch, args.dtype))
            ways: dict[str, Callable[[], Any]] = {
                "gathered": partial(rows.gathered, q, cache, gqa=gqa),
                "gather_alone": partial(rows.read, cache),
                "by_row": partial(rows.by_row, q, cache, gqa=gqa),
                "kernel_by_row": partial(kernel_by_row, q, rows),
            }
            for name, way in ways.items():
                table[name][str(count)] = round(_median_us(way, args.repeats), 1)
            gap = (rows.by_row(q, cache, gqa=gqa).float() - rows.gathered(q, cache, gqa=gqa).float()).abs().max()
            table["max_difference"][str(count)] = float(gap)
    shape = {"heads": args.heads, "kv_heads": args.kv_heads or args.heads, "head_dim": args.head_dim}
    doc = {"torch": torch.__version__, "dtype": args.dtype, "threads": 1, "context": args.context, **shape, "us": table}
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
