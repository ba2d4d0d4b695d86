"""Sequences at once and tokens/s at one KV budget: slots reserved at full context against K/V by tokens.

Usage:  PYTHONPATH=. python benchmarks/kv_by_tokens.py [--budget-slots 8] [--max-seq 4096] [--requests 32]
            [--layers 2] [--vocab 32000] [--answer 24] [--seed 0] [--admission-requests 512]
            [--rounds 3] [--out FILE]

One CPU stage of a Qwen2.5-0.5B-wide decoder (d_model 896, 14 heads, 2 KV heads, MLP 4864; ``--layers`` blocks and
a ``--vocab`` head so it runs in minutes on two cores; seeded random weights; products as F.linear), driven by the
service's scheduler (``serve.scheduler``) and greedy picks, steps of up to 256 tokens, chunks of 64. A KV budget of
``--budget-slots`` x ``--max-seq`` tokens; ``--requests`` requests of 300 ± 200 tokens (prompt + answer, uniform),
each answering ``--answer`` tokens, all queued at once. "before": the budget as slots at full context (that many
sequences at once, as ``SlotCache`` reserved them); "after": the same budget in tokens, blocks of 64, ``--slots``
at its default (``serve.options.default_slots``). For each: the most sequences running at once, the most KV
positions the stage held, preemptions, the positions the steps carried (rows right-padded to the longest; a CPU
stage runs decode rows apart from chunks, ``BatchedStage._split``) against the real ones, wall seconds and tokens/s
(prompt + generated; the first round's figures, and every round's tokens/s, the two alternated ``--rounds``
times). Then the scheduler alone (no model) over ``--admission-requests`` requests: the most
sequences at once when the budget, not the request count, is the limit. Prints one JSON document (also to --out).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import torch
from _report import emit  # benchmarks/_report.py, beside this script

from raycluster_cli.models.batched import BatchedStage
from raycluster_cli.models.config import ModelConfig
from raycluster_cli.serve.engine import step_inputs
from raycluster_cli.serve.options import default_slots
from raycluster_cli.serve.scheduler import Limits, Scheduler


def _requests(count: int, answer: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(100, 500) - answer)] for _ in range(count)]


def _run(stage: BatchedStage, limits: Limits, prompts: list[list[int]], answer: int) -> dict[str, Any]:
    """Every request through the scheduler and the stage until all have answered."""
    s = Scheduler(limits)
    for i, prompt in enumerate(prompts):
        s.add(f"r{i}", prompt, answer, queue_limit=False, ignore_eos=True)
    tokens = sum(len(p) for p in prompts) + answer * len(prompts)
    most = held = steps = padded = 0
    began = time.perf_counter()
    while s.has_work:
        chunks = s.schedule()
        stage.release(s.take_released())
        most = max(most, len(s.running))
        ids, table = step_inputs(chunks)
        padded += ids.numel()
        logits = stage.forward(ids, table)
        held = max(held, stage.held_tokens)
        picks = logits.argmax(-1).tolist()
        s.complete(chunks, {c.request_id: picks[row] for row, c in enumerate(chunks) if c.samples})
        steps += 1
    stage.release(s.take_released())
    wall = time.perf_counter() - began
    return {
        "slots": limits.slots,
        "kv_budget_tokens": limits.kv_budget,
        "most_running_at_once": most,
        "most_kv_positions_held": held,
        "preemptions": s.preemptions,
        "steps": steps,
        "positions_in_steps_padded": padded,
        "positions_real": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1),
        "held_after": stage.held_tokens,
    }


def _admitted(limits: Limits, prompts: list[list[int]], answer: int) -> dict[str, int]:
    """The scheduler alone (every step's tokens come back at once, token 0): the most sequences running at once
    and the preemptions, for more requests than the model run takes time for."""
    s = Scheduler(limits)
    for i, prompt in enumerate(prompts):
        s.add(f"r{i}", prompt, answer, queue_limit=False, ignore_eos=True)
    most = 0
    while s.has_work:
        chunks = s.schedule()
        most = max(most, len(s.running))
        s.complete(chunks, {c.request_id: 0 for c in chunks if c.samples})
    return {"most_running_at_once": most, "preemptions": s.preemptions}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-slots", type=int, default=8)
    p.add_argument("--max-seq", type=int, default=4096)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--answer", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--admission-requests", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    cfg = ModelConfig(
        vocab=args.vocab, d_model=896, heads=14, kv_heads=2, ffn=4864, layers=args.layers, max_seq=args.max_seq,
        arch="llama", activation="silu", qkv_bias=True, seed=args.seed,
    )  # fmt: skip
    budget = args.budget_slots * args.max_seq
    prompts = _requests(args.requests, args.answer, args.seed, args.vocab)
    common = {"max_seq": args.max_seq, "prefill_chunk": 64, "step_tokens": 256, "max_waiting": args.requests}
    runs = {
        "before": Limits(slots=args.budget_slots, **common),
        "after": Limits(slots=default_slots(budget), kv_tokens=budget, kv_block=64, **common),
    }
    report: dict[str, Any] = {
        "model": {"d_model": 896, "layers": args.layers, "vocab": args.vocab, "dtype": cfg.dtype},
        "requests": args.requests,
        "tokens_per_request": "300 ± 200 (uniform 100-500)",
        "answer_tokens": args.answer,
        "threads": torch.get_num_threads(),
    }
    for round_ in range(args.rounds):  # alternated: a shared machine's load falls on both alike
        for name, limits in runs.items():
            # a stage of its own each run: its count of sequences begun per slot starts with its scheduler's
            stage = BatchedStage(
                cfg, 0, cfg.num_units, limits.slots, kv_tokens=limits.kv_budget, kv_block=64, measure_matmuls=False
            )
            result = _run(stage, limits, prompts, args.answer)
            print(round_, name, result, flush=True)
            if name in report:
                report[name]["tokens_per_s_rounds"].append(result["tokens_per_s"])
            else:
                report[name] = result | {"tokens_per_s_rounds": [result["tokens_per_s"]]}
    report["running_at_once_after_over_before"] = round(
        report["after"]["most_running_at_once"] / report["before"]["most_running_at_once"], 2
    )
    many = _requests(args.admission_requests, args.answer, args.seed + 1, args.vocab)
    report["scheduler_alone"] = {"requests": len(many)} | {
        name: _admitted(limits, many, args.answer) for name, limits in runs.items()
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
