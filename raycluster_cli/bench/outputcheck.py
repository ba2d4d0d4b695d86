"""``--check-output``: the pipeline's greedy tokens against the model computed in this (the driver's) process.

When the whole model fits the memory this process's container has left, it is built once and the same
micro-batches are decoded again (identically shaped matmuls).  When it does not, which is why a model is
sharded at all, the check goes unit by unit instead: each request's prompt + generated tokens run through
the model in one teacher-forced pass, one unit built at a time and freed before the next, and the greedy
token at every generated position must be the one the pipeline produced.  A unit larger than the room
left skips the check, with the reason.
"""

from __future__ import annotations

from typing import Any

import torch

from raycluster_cli.bench import memory
from raycluster_cli.bench.model import ModelConfig, Stage, full_model_stage, greedy_generate
from raycluster_cli.bench.results import BenchParams, RunResult
from raycluster_cli.bench.workload import make_prompts


def _rows_to_check(result: RunResult, num_requests: int) -> list[list[int]]:
    groups, compared = [], 0
    for rows in result.groups:
        if compared >= max(1, num_requests):
            break
        groups.append(list(rows))
        compared += len(rows)
    return groups


def _unit_by_unit(cfg: ModelConfig, sequences: torch.Tensor, prompt_len: int) -> list[list[int]]:
    """Teacher-forced greedy tokens of every generated position, the model built one unit at a time."""
    x: torch.Tensor = sequences[:, :-1]
    for unit in range(cfg.num_units):
        stage = Stage(cfg, unit, unit + 1, emit="logits")
        x = stage(x, "check", 0)
        del stage
    predicted: list[list[int]] = x[:, prompt_len - 1 :].argmax(-1).tolist()
    return predicted


def check_output(
    cfg: ModelConfig, params: BenchParams, result: RunResult, num_requests: int = 8, room: int | None = None
) -> dict[str, Any]:
    """Compare the pipeline's greedy tokens with the model's, micro-batch by micro-batch; ``room``: the bytes
    this process may still use (None: unbounded)."""
    prompts = make_prompts(cfg.vocab, params.requests, params.prompt_len, params.seed)
    groups = _rows_to_check(result, num_requests)
    tokens = max(params.prefill_chunk or params.prompt_len, params.prompt_len + params.max_new_tokens)
    whole = memory.demand(cfg, params.micro_batch, params.prefill_chunk or params.prompt_len)
    per_unit = memory.demand(cfg, params.micro_batch, tokens)
    method = "whole model"
    if room is not None and whole.total > room:
        method = "unit by unit, teacher-forced"
        largest = max(per_unit.units) + per_unit.fixed
        if largest > room:
            reason = f"its largest unit needs {memory.gb(largest)}, the driver has {memory.gb(room)} left"
            return {"identical": None, "skipped": f"the model does not fit the driver's memory and {reason}"}
    mismatched: list[int] = []
    model = full_model_stage(cfg, emit="tokens") if method == "whole model" else None
    for rows in groups:
        expected: list[list[int]]
        if model is not None:
            new = params.max_new_tokens
            expected = greedy_generate([model], prompts[rows], new, prefill_chunk=params.prefill_chunk).tolist()
        else:
            generated = torch.tensor([result.tokens[row] for row in rows], dtype=torch.long)
            expected = _unit_by_unit(cfg, torch.cat([prompts[rows], generated], dim=1), params.prompt_len)
        mismatched.extend(row for row, exp in zip(rows, expected, strict=True) if result.tokens[row] != exp)
    compared = sum(len(rows) for rows in groups)
    return {
        "identical": not mismatched and compared > 0,
        "compared_requests": compared,
        "mismatched": mismatched,
        **({"method": method} if method != "whole model" else {}),
    }
