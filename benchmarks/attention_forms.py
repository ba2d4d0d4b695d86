"""What a decode step's attention costs a CPU stage in each of `models/batched.py`'s two forms, one block.

Usage:  PYTHONPATH=. python benchmarks/attention_forms.py [--dtype float32|bfloat16] [--rows 1,2,4,8,16]
            [--context 120] [--heads 8] [--head-dim 64] [--repeats 200] [--out FILE]

For each row count B: B decode rows (one query each) in slots 0..B-1 of a 16-slot KV cache of one block, row i
at position `--context` + 7·i, one thread.  The median µs of `Rows.gathered` (every row's keys and values gathered
into one tensor, one masked attention: the GPU's form), of the gather alone, and of `Rows.by_row` (each row on
views of its own slot, no mask: the CPU's form), and the largest difference between the two forms' outputs.
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
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    counts = [int(r) for r in args.rows.split(",")]
    cfg = ModelConfig(
        vocab=64, d_model=args.heads * args.head_dim, heads=args.heads, layers=1, arch="llama", activation="silu",
        max_seq=args.context + 7 * max(counts) + 1, dtype=args.dtype,
    )  # fmt: skip
    cache = SlotCache(max(16, max(counts)), cfg, torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape))
    cache.v.copy_(torch.randn(cache.v.shape))
    table: dict[str, dict[str, float]] = {"gathered": {}, "gather_alone": {}, "by_row": {}, "max_difference": {}}
    with torch.inference_mode():
        for count in counts:
            starts = args.context + 7 * torch.arange(count)
            rows = Rows.from_table(torch.stack([torch.arange(count), starts, torch.ones(count, dtype=torch.long)]), 1)
            q = torch.randn(count, args.heads, 1, args.head_dim).to(getattr(torch, args.dtype))
            ways: dict[str, Callable[[], Any]] = {
                "gathered": partial(rows.gathered, q, cache),
                "gather_alone": partial(rows.read, cache),
                "by_row": partial(rows.by_row, q, cache),
            }
            for name, way in ways.items():
                table[name][str(count)] = round(_median_us(way, args.repeats), 1)
            gap = (rows.by_row(q, cache).float() - rows.gathered(q, cache).float()).abs().max()
            table["max_difference"][str(count)] = float(gap)
    doc = {"torch": torch.__version__, "dtype": args.dtype, "threads": 1, "context": args.context, "us": table}
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
