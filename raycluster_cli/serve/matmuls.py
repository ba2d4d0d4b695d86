"""How a stage multiplies a decode step's few rows by its weights on a CPU: the cheapest of a few forms, measured.

``F.linear(x, W)`` computes ``x @ Wᵀ``; the same rows come out of ``(W @ xᵀ)ᵀ``, and out of a product of
more rows whose extra rows are zeros.  The BLAS behind torch picks its kernel by the operands' shapes and
layouts, and for the few rows of a decode step, with weights streamed from memory, the forms differ a lot.
On the lab's CPU (AMD EPYC, torch 2.13's MKL, one thread, float32, blocks of width 512 whose weights do not
stay in the cache), per block: ``F.linear`` 1.14 / 1.70 / 1.88 / 1.60 ms for 1 / 2 / 3 / 4 rows, ``W @ xᵀ``
1.11 / 0.74 / 1.05 / 1.54 — so a step of one row is cheapest as two rows (the second zeros) in the second
form, 1.5× faster than ``F.linear``; in bfloat16 ``F.linear`` is the fastest at every row count.  Which form
wins depends on the CPU, the BLAS and the dtype, so each stage measures them on its own matrices when it
loads (the cache flushed before each timing: between two steps a stage's neighbours evict its weights) and
keeps, for each row count up to ``MOST_ROWS``, the cheapest form and padding; larger steps (prompt chunks,
full batches) and every step on a GPU use ``F.linear``.  A row's numbers are those of a different summation
order (the rounding of float32), never another row's: padding rows are zeros and each output row is its own
row's dot products.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

MOST_ROWS = 8  # steps of up to this many rows are planned; larger ones are the products BLAS already does well
MIN_GAIN = 0.10  # another form replaces F.linear only where measured this much cheaper (a smaller lead is noise)
PROBE_BUDGET_S = 2.0  # a large stage measures fewer row counts (the rest keep F.linear), never waits long
PROBE_BYTES = 96 * 2**20  # at most this much of the stage's matrices is timed: their cost per byte is the same
REPEATS = 3

Plan = Mapping[int, tuple[bool, int]]  # rows -> (as W @ xᵀ, rows computed: the step's, or more with zero rows)


def _flipped(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ Wᵀ`` as ``(W @ xᵀ)ᵀ``, made contiguous (what follows views it by heads)."""
    return torch.mm(weight, x.t()).t().contiguous()


def _product(weight: torch.Tensor, x: torch.Tensor, flipped: bool, rows: int) -> torch.Tensor:
    """``x @ Wᵀ`` for the 2-D ``x``, computed over ``rows`` rows (x's own, then zeros) in the chosen form."""
    if rows > x.shape[0]:
        x = torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])
    return _flipped(weight, x) if flipped else F.linear(x, weight)


class Matmuls:
    """``apply(linear, x)`` = ``linear(x)``, computed in the form the plan holds for x's row count."""

    def __init__(self, plan: Plan | None = None) -> None:
        self.plan = {rows: how for rows, how in (plan or {}).items() if how != (False, rows)}

    def apply(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        how = self.plan.get(rows)
        if how is None:
            out: torch.Tensor = linear(x)
            return out
        flat = _product(linear.weight, x.reshape(rows, x.shape[-1]), *how)[:rows]
        if linear.bias is not None:
            flat = flat + linear.bias
        return flat.reshape(*x.shape[:-1], linear.out_features)

    def describe(self) -> dict[str, str]:
        """Each planned row count and how it is computed (none: ``F.linear`` for every step)."""
        return {
            str(rows): f"{'W @ xT' if flipped else 'F.linear'} over {padded} rows"
            for rows, (flipped, padded) in sorted(self.plan.items())
        }


def plan_from_costs(costs: Mapping[int, tuple[float, float]]) -> dict[int, tuple[bool, int]]:
    """From each measured row count's (``F.linear``, ``W @ xᵀ``) seconds: for every row count, the cheapest
    form and number of rows to compute (its own, or more with zero rows), where that beats ``F.linear`` at its
    own count by over ``MIN_GAIN``."""
    plan: dict[int, tuple[bool, int]] = {}
    for rows, (plain, _) in costs.items():
        options = [
            (seconds, (form == 1, more))
            for more, pair in costs.items()
            if more >= rows
            for form, seconds in enumerate(pair)
        ]
        seconds, how = min(options)
        if seconds < (1 - MIN_GAIN) * plain:
            plan[rows] = how
    return plan


def cache_bytes() -> int:
    """The last-level cache's size (Linux sysfs), 64 MiB when unknown."""
    for index in (3, 2):
        try:
            text = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size").read_text().strip().upper()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        if text and text[-1] in units and text[:-1].isdigit():
            return int(text[:-1]) * units[text[-1]]
    return 64 * 2**20


def _timed(step: Callable[[], object]) -> float:
    began = time.perf_counter()
    step()
    return time.perf_counter() - began


def measure(linears: Sequence[nn.Linear], *, most_rows: int = MOST_ROWS, budget_s: float = PROBE_BUDGET_S) -> Matmuls:
    """Time ``F.linear`` and ``W @ xᵀ`` for 1..``most_rows`` rows over ``linears`` (a stage's matrices, at most
    ``PROBE_BYTES`` of them), each ``REPEATS`` times alternately after a warm-up, the cache flushed before
    every timing; the row counts not reached within ``budget_s`` keep ``F.linear``.  CPU only."""
    chosen: list[nn.Linear] = []
    total = 0
    for linear in linears:
        if total >= PROBE_BYTES:
            break
        chosen.append(linear)
        total += linear.weight.numel() * linear.weight.element_size()
    if not chosen:
        return Matmuls()
    dtype = chosen[0].weight.dtype
    flush = torch.zeros(min(2 * cache_bytes(), 512 * 2**20) // 4, dtype=torch.float32)
    costs: dict[int, tuple[float, float]] = {}
    began = time.perf_counter()
    with torch.inference_mode():
        for rows in range(1, most_rows + 1):
            if time.perf_counter() - began > budget_s:
                break
            inputs = [torch.randn(rows, m.in_features, dtype=dtype) for m in chosen]

            def run(flipped: bool, inputs: list[torch.Tensor] = inputs, rows: int = rows) -> float:
                flush.add_(1.0)  # every cache line of the flush buffer touched: the weights are evicted
                pairs = list(zip(inputs, chosen, strict=True))
                return _timed(lambda: [_product(m.weight, x, flipped, rows) for x, m in pairs])

            run(False), run(True)  # warm up: first touches, the BLAS's own set-up for the shape
            samples = [(run(False), run(True)) for _ in range(REPEATS)]
            costs[rows] = (min(s[0] for s in samples), min(s[1] for s in samples))
    return Matmuls(plan_from_costs(costs))
