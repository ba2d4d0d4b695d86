"""``serve --quantize int8`` against bfloat16 on one CPU stage holding a whole model: what a decode step costs,
and how far int8's next-token choices move (issue 49: "int8 weight-only as an option with its accuracy measured").

Usage:  PYTHONPATH=. python benchmarks/int8_vs_bf16.py CHECKPOINT_DIR [--rows 16] [--prompt 128] [--accuracy-rows 4] [--steps 12]
            [--rounds 3] [--out FILE]

The checkpoint (``benchmarks/real_shapes.py`` writes random ones at real shapes) is loaded twice as one
``BatchedStage`` (one thread), bfloat16 and int8.  Accuracy: ``--accuracy-rows`` prompts of ``--prompt`` random tokens
teacher-forced through both, every position's logits: int8 and bfloat16 each against float32: how often the top token is
float32's, how often float32's top token is among the top 5, and the largest difference of the log-probabilities
relative to float32's spread.  Cost: ``--rows`` sequences prefilled, then ``--steps`` decode steps of all of them, each
step's process CPU time (the median), the two alternated ``--rounds`` times.  Prints one JSON document.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from _report import emit  # benchmarks/_report.py, beside this script

from raycluster_cli.models.batched import BatchedStage
from raycluster_cli.models.decoder import config_from_checkpoint


def _against(reference: torch.Tensor, other: torch.Tensor) -> dict[str, float]:
    top = reference.argmax(-1)
    in_top5 = (other.topk(5, dim=-1).indices == top[..., None]).any(-1)
    return {
        "top1_agreement": round(float((other.argmax(-1) == top).float().mean()), 4),
        "reference_top1_in_top5": round(float(in_top5.float().mean()), 4),
        "max_logprob_diff_over_reference_std": round(float((other - reference).abs().max() / reference.std()), 4),
    }


def _accuracy(stages: dict[str, BatchedStage], vocab: int, rows: int, prompt: int) -> dict[str, Any]:
    """int8 and bfloat16 each against float32 (bfloat16's own distance is the scale int8's is read on: a random
    checkpoint's logits are nearly flat, so any rounding moves many of its top choices)."""
    ids = torch.randint(0, vocab, (rows, prompt), generator=torch.Generator().manual_seed(7))
    table = torch.tensor([list(range(rows)), [0] * rows, [prompt] * rows, [1] * rows])
    logits = {name: stage.forward(ids, table).float().log_softmax(-1) for name, stage in stages.items()}
    reference = logits.pop("float32")
    return {name: _against(reference, other) for name, other in logits.items()} | {"positions": rows * prompt}


def _decode_cost(stage: BatchedStage, vocab: int, rows: int, prompt: int, steps: int) -> float:
    gen = torch.Generator().manual_seed(0)
    for row in range(rows):
        stage.forward(torch.randint(0, vocab, (1, prompt), generator=gen), torch.tensor([[row], [0], [prompt]]))
    times = []
    for step in range(steps):
        ids = torch.randint(0, vocab, (rows, 1), generator=gen)
        table = torch.tensor([list(range(rows)), [prompt + step] * rows, [1] * rows])
        began = time.process_time()
        stage.forward(ids, table)
        times.append(time.process_time() - began)
    stage.release([(row, stage.begun[row]) for row in range(rows)])
    return statistics.median(times[2:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--accuracy-rows", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = config_from_checkpoint(args.checkpoint, max_seq=args.prompt + args.steps + 1, dtype="bfloat16")
    stages = {
        name: BatchedStage(replace(cfg, quantize=q), 0, cfg.num_units, args.rows)
        for name, q in (("bfloat16", ""), ("int8", "int8"))
    }
    full = BatchedStage(replace(cfg, dtype="float32"), 0, cfg.num_units, args.accuracy_rows, measure_matmuls=False)
    with torch.inference_mode():
        accuracy = _accuracy({"float32": full} | stages, cfg.vocab, args.accuracy_rows, args.prompt)
        del full
        report: dict[str, Any] = {
            "checkpoint": str(args.checkpoint),
            "layers": cfg.layers,
            "d_model": cfg.d_model,
            "vocab": cfg.vocab,
            "rows": args.rows,
            "accuracy_against_float32": accuracy,
            "decode_step_cpu_ms": {name: [] for name in stages},
        }
        for _ in range(args.rounds):
            for name, stage in stages.items():
                cost = _decode_cost(stage, cfg.vocab, args.rows, args.prompt, args.steps)
                report["decode_step_cpu_ms"][name].append(round(cost * 1000, 1))
    costs = report["decode_step_cpu_ms"]
    report["int8_over_bf16_step_p50"] = round(
        statistics.median(costs["int8"]) / statistics.median(costs["bfloat16"]), 3
    )
    emit(report, args.out)


if __name__ == "__main__":
    main()
