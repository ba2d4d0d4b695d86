"""``--check-output``: the pipeline's greedy tokens against the model computed in this (the driver's) process.

When the whole model fits the memory this process's container has left, it is built once and the same
micro-batches are decoded again (identically shaped matmuls).  When it does not, which is why a model is
sharded at all, the check goes unit by unit instead: each request's prompt + generated tokens run through
the model in one teacher-forced pass, one unit built at a time and freed before the next, and the greedy
token at every generated position must be the one the pipeline produced.  A unit larger than the room
left skips the check, with the reason.

In reduced precision (bfloat16, float16) the pipeline's stages and this process run different kernels (CUDA on
the stages' GPUs, the CPU here; other batch shapes), so equal greedy tokens cannot be asked for: on an H200,
bfloat16 stages against this process's bfloat16 differed in 15 of 16 requests of a random model (nearly flat
logits), where float32 was identical. There the check is teacher-forced (the pipeline's own tokens fed back,
so one early difference does not make every later token differ) and each generated token must be among the
reference's TOP_K at its position, as vLLM's tests compare logprobs; the share of positions whose argmax agreed
is reported. The strict comparison runs first (on CPUs it usually holds); only where it fails is the
tolerance added. `identical` stays the strict verdict; `tolerance.within` is the reduced-precision one.
"""

from __future__ import annotations

from typing import Any

import torch

from raycluster_cli.bench.results import BenchParams, RunResult
from raycluster_cli.bench.workload import make_prompts
from raycluster_cli.models.decoder import ModelConfig, Stage, full_model_stage, greedy_generate
from raycluster_cli.placement import memory


def _rows_to_check(result: RunResult, num_requests: int) -> list[list[int]]:
    groups, compared = [], 0
    for rows in result.groups:
        if compared >= max(1, num_requests):
            break
        groups.append(list(rows))
        compared += len(rows)
    return groups


TOP_K = 5  # reduced precision: each generated token must be among the reference's 5 likeliest there


def _teacher_forced_logits(cfg: ModelConfig, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The logits at every generated position given the tokens before it, the model built one unit at a time."""
    x: torch.Tensor = sequences[:, :-1]
    for unit in range(cfg.num_units):
        stage = Stage(cfg, unit, unit + 1, emit="logits")
        x = stage(x, "check", 0)
        del stage
    return x[:, prompt_len - 1 :]


def _unit_by_unit(cfg: ModelConfig, sequences: torch.Tensor, prompt_len: int) -> list[list[int]]:
    """Teacher-forced greedy tokens of every generated position, the model built one unit at a time."""
    predicted: list[list[int]] = _teacher_forced_logits(cfg, sequences, prompt_len).argmax(-1).tolist()
    return predicted


def _within_tolerance(
    cfg: ModelConfig, prompts: torch.Tensor, result: RunResult, groups: list[list[int]], prompt_len: int
) -> dict[str, Any]:
    """Reduced precision: teacher-forced, each generated token among the reference's TOP_K there; the share of
    positions whose reference argmax is the generated token."""
    positions = agreed = 0
    outside: list[int] = []
    for rows in groups:
        generated = torch.tensor([result.tokens[row] for row in rows], dtype=torch.long)
        logits = _teacher_forced_logits(cfg, torch.cat([prompts[rows], generated], dim=1), prompt_len)
        top = logits.float().topk(TOP_K, dim=-1).indices
        agree = top[..., 0] == generated
        inside = (top == generated[..., None]).any(-1)
        positions += generated.numel()
        agreed += int(agree.sum())
        outside.extend(row for row, ok in zip(rows, inside.all(-1).tolist(), strict=True) if not ok)
    compared = sum(len(rows) for rows in groups)
    return {
        "dtype": cfg.dtype,
        "top_k": TOP_K,
        "positions": positions,
        "argmax_agreed": round(agreed / positions, 4) if positions else None,
        "outside_top_k": outside,
        "within": not outside and compared > 0,
    }


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
    strict = {
        "identical": not mismatched and compared > 0,
        "compared_requests": compared,
        "mismatched": mismatched,
        **({"method": method} if method != "whole model" else {}),
    }
    if cfg.dtype == "float32" or strict["identical"]:
        return strict
    return {**strict, "tolerance": _within_tolerance(cfg, prompts, result, groups, params.prompt_len)}
