"""What a decode step's products cost on this CPU in each form `models/matmuls.py` chooses from, and a whole stage's step.

Usage:  PYTHONPATH=. python benchmarks/matmul_forms.py [--dtype float32|bfloat16] [--rows 1,2,3,4,6,8,16,32]
            [--width 512 --ffn 1376] [--repeats 9] [--stage-blocks 4] [--context 120] [--out FILE]

1. The seven matrices of one Llama block (q, k, v, o: width x width; gate, up: ffn x width; down: width x ffn),
   one thread, the last-level cache flushed before every timing (a stage's neighbours evict its weights
   between two of its steps): per row count the median ms of `F.linear`, `W @ xT` and oneDNN's inner product on
   the packed weights, and each form's largest difference from `F.linear` relative to its largest value.
2. A `serve` stage of the embedding and `--stage-blocks` blocks of the lab's model (`BatchedStage`, its products as
   it measured them when it loaded; and again with `F.linear` everywhere): the median ms of a decode step of each
   row count, its rows' sequences `--context` tokens long (each row 7 more than the one before, in its own slot),
   and the plan it chose.
Prints one JSON document (also to --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from raycluster_cli.models.batched import BatchedStage
from raycluster_cli.models.config import ModelConfig
from raycluster_cli.models.matmuls import FLIPPED, FORMS, LINEAR, PACKED, _product, cache_bytes, pack, packable


def _median_ms(step: Callable[[], object], flush: torch.Tensor, repeats: int) -> float:
    samples = []
    for _ in range(repeats + 1):
        flush.add_(1.0)
        began = time.perf_counter()
        step()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples[1:]) * 1e3  # the first: the libraries' set-up for the shape


def forms(args: argparse.Namespace, rows: list[int], flush: torch.Tensor) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    shapes = [(args.width, args.width)] * 4 + [(args.ffn, args.width)] * 2 + [(args.width, args.ffn)]
    linears = [nn.Linear(i, o, bias=False).to(dtype) for o, i in shapes]
    packed = {m: pack(m.weight) for m in linears} if packable(dtype) else {}
    kinds = [LINEAR, FLIPPED] + ([PACKED] if packed else [])
    table: dict[str, dict[str, float]] = {FORMS[k]: {} for k in kinds}
    error: dict[str, float] = {}
    with torch.inference_mode():
        for count in rows:
            xs = [torch.randn(count, m.in_features, dtype=dtype) for m in linears]
            want = [m(x) for m, x in zip(linears, xs, strict=True)]
            for kind in kinds:
                got = [_product(m, x, kind, count, packed) for m, x in zip(linears, xs, strict=True)]
                worst = max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want, strict=True))
                error[FORMS[kind]] = max(error.get(FORMS[kind], 0.0), worst)
                ms = _median_ms(
                    lambda kind=kind, xs=xs, count=count: [
                        _product(m, x, kind, count, packed) for m, x in zip(linears, xs, strict=True)
                    ],
                    flush,
                    args.repeats,
                )
                table[FORMS[kind]][str(count)] = round(ms, 3)
    block_mb = sum(o * i for o, i in shapes) * linears[0].weight.element_size() / 2**20
    return {"block_mb": round(block_mb, 2), "ms_per_block": table, "max_relative_difference": error}


def stage_steps(args: argparse.Namespace, rows: list[int], flush: torch.Tensor) -> dict[str, Any]:
    cfg = ModelConfig(
        vocab=32000, d_model=args.width, heads=8, layers=8, max_seq=args.context + 7 * max(rows) + 1, arch="llama", ffn=args.ffn,
        activation="silu", dtype=args.dtype,
    )  # fmt: skip
    out: dict[str, Any] = {}
    for name, measured in (("measured", True), ("f_linear", False)):
        stage = BatchedStage(cfg, 0, 1 + args.stage_blocks, slots=max(rows), measure_matmuls=measured)
        steps = {}
        for count in rows:
            ids = torch.randint(0, cfg.vocab, (count, 1))
            starts = args.context + 7 * torch.arange(count)
            table = torch.stack([torch.arange(count), starts, torch.ones(count, dtype=torch.long)])
            steps[str(count)] = round(
                _median_ms(lambda ids=ids, table=table, stage=stage: stage.forward(ids, table), flush, args.repeats), 3
            )
        out[name] = {
            "step_ms": steps,
            "plan": stage.block_mm.describe(),
            "packed_mb": stage.block_mm.packed_bytes / 2**20,
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rows", default="1,2,3,4,6,8,16,32")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1376)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--stage-blocks", type=int, default=4)
    p.add_argument("--context", type=int, default=120, help="the stage steps' rows' positions (KV cache length)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    flush = torch.zeros(min(2 * cache_bytes(), 512 * 2**20) // 4)
    doc = {
        "torch": torch.__version__,
        "dtype": args.dtype,
        "threads": 1,
        "forms": forms(args, rows, flush),
        "stage": stage_steps(args, [r for r in rows if r <= 16], flush),
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
