"""How a stage multiplies a step's rows by its weights on a CPU: the cheapest of a few forms, measured.

``F.linear(x, W)`` computes ``x @ Wᵀ``; the same rows come out of ``(W @ xᵀ)ᵀ``, out of oneDNN's inner
product on a copy of ``W`` reordered into the layout its kernels stream ("packed"), and out of a product of
more rows whose extra rows are zeros.  The libraries behind torch pick their kernels by the operands' shapes
and layouts, and for the few rows of a decode step, with weights streamed from memory, the forms differ a
lot.  On the lab's CPU (AMD EPYC with AVX-512, torch 2.13: MKL and oneDNN 3.12, one thread, a Llama block of
width 512 whose 12.4 MB of float32 weights do not stay in the cache), per block:

=========  ====  ====  ====  ====  ====  ====  ====
rows       1     2     3     4     6     8     32
=========  ====  ====  ====  ====  ====  ====  ====
F.linear   1.02  1.68  2.28  1.33  1.84  1.57  3.24
W @ xᵀ     1.08  0.75  1.06  1.28  1.81  2.04  3.79
packed     1.08  1.13  1.05  0.96  0.98  1.19  2.44
=========  ====  ====  ====  ====  ====  ====  ====

so a step of one or two rows is cheapest as two rows in the second form (0.75 ms: the weights streamed at
16.5 GB/s), three to eight rows and larger steps (prompt chunks, full batches) packed; in bfloat16 the
packed form is the cheapest at every row count (0.66–0.71 ms for 1–6 rows: a step's cost hardly grows with
its rows).  Which form wins depends on the CPU, its libraries and the dtype, so each stage measures them on
its own matrices when it loads (the cache flushed before each timing: between two steps a stage's
neighbours evict its weights) and keeps, for each row count up to ``MOST_ROWS``, the cheapest form and
padding, and for larger steps the form that won at the nearest of ``LARGE_ROWS``; every step on a GPU uses
``F.linear``.  The packed copy costs the matrices' bytes again, so a stage makes it only where its node has
that room to spare (``spare_bytes``), and drops it when no step would use it.  A row's numbers are those of
a different summation order (the rounding of the dtype), never another row's: padding rows are zeros and
each output row is its own row's dot products.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

LINEAR, FLIPPED, PACKED = 0, 1, 2
FORMS = ("F.linear", "W @ xT", "packed")
MOST_ROWS = 8  # steps of up to this many rows are planned row count by row count
LARGE_ROWS = (16, 64)  # larger steps take the packed form where it wins at each of these
MIN_GAIN = 0.10  # another form replaces F.linear only where measured this much cheaper (a smaller lead is noise)
PROBE_BUDGET_S = 2.5  # a large stage measures fewer row counts (the rest keep F.linear), never waits long
PROBE_BYTES = 96 * 2**20  # at most this much of the stage's matrices is timed: their cost per byte is the same
REPEATS = 3
PACK_HINT = MOST_ROWS  # the batch size oneDNN lays the packed weights out for (its kernels take any)

Plan = Mapping[int, tuple[int, int]]  # rows -> (form, rows computed: the step's, or more with zero rows)
# a larger step's form by the larger row count measured nearest it (in ratio: 16 takes steps of 9-32, 64 the rest)
LargePlan = Mapping[int, int]


def weight_bytes(linears: Iterable[nn.Linear]) -> int:
    """The bytes of ``linears``' weight matrices (what a packed copy of them takes again)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in linears)


def packable(dtype: torch.dtype) -> bool:
    """Whether this torch has oneDNN's packed inner product for ``dtype`` on the CPU."""
    return (
        dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` copied into the layout oneDNN's inner product streams."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT)
    return packed


def _flipped(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ Wᵀ`` as ``(W @ xᵀ)ᵀ``, made contiguous (what follows views it by heads)."""
    return torch.mm(weight, x.t()).t().contiguous()


def _product(
    linear: nn.Linear, x: torch.Tensor, form: int, rows: int, packed: Mapping[nn.Linear, torch.Tensor]
) -> torch.Tensor:
    """``linear(x)`` for the 2-D ``x``, computed over ``rows`` rows (x's own, then zeros) in the chosen form."""
    if rows > x.shape[0]:
        x = torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])
    if form == PACKED:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), packed[linear], linear.bias, "none", [], ""
        )
        return out
    flat = _flipped(linear.weight, x) if form == FLIPPED else F.linear(x, linear.weight)
    return flat if linear.bias is None else flat + linear.bias


class Matmuls:
    """``apply(linear, x)`` = ``linear(x)``, computed in the form the plan holds for x's row count
    (``large`` for steps of more than ``most_rows`` rows)."""

    def __init__(
        self,
        plan: Plan | None = None,
        packed: Mapping[nn.Linear, torch.Tensor] | None = None,
        large: int | LargePlan = LINEAR,
        most_rows: int = MOST_ROWS,
    ) -> None:
        self.plan = {rows: how for rows, how in (plan or {}).items() if how != (LINEAR, rows)}
        self.packed = dict(packed or {})
        # one form for every larger step, or a form per larger row count measured (``large_forms``)
        self.large: dict[int, int] = dict(large) if isinstance(large, Mapping) else {most_rows + 1: large}
        self.most_rows = most_rows
        if PACKED in self.forms and not self.packed:
            raise ValueError("a plan with the packed form needs the packed weights")

    @property
    def forms(self) -> set[int]:
        """Every form some step is computed in."""
        return {form for form, _ in self.plan.values()} | set(self.large.values())

    def large_form(self, rows: int) -> int:
        """The form of a step of ``rows`` > ``most_rows``: that of the larger row count measured nearest it, in
        ratio (the boundary between two measured counts is their geometric mean)."""
        counts = sorted(self.large)
        for at, measured in enumerate(counts):
            if at + 1 == len(counts) or rows * rows <= measured * counts[at + 1]:
                return self.large[measured]
        return LINEAR

    def apply(self, linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        how = self.plan.get(rows)
        if how is None and rows > self.most_rows and (form := self.large_form(rows)) != LINEAR:
            how = (form, rows)
        if how is None:
            out: torch.Tensor = linear(x)
            return out
        flat = _product(linear, x.reshape(rows, x.shape[-1]), *how, self.packed)[:rows]
        return flat.reshape(*x.shape[:-1], linear.out_features)

    @property
    def uses_packed(self) -> bool:
        return PACKED in self.forms

    def over(self, linears: Sequence[nn.Linear]) -> Matmuls:
        """The same plan for other matrices of the same shapes and dtype (another stage of the model it was
        measured on): what was measured is the node's and the shapes', not these weights'.  Packed copies of
        ``linears`` are made where the plan packs; none to multiply (a stage without a head): ``F.linear``'s empty
        plan."""
        if not linears:
            return Matmuls()
        with torch.inference_mode():
            packed = {m: pack(m.weight) for m in linears} if self.uses_packed else {}
        return Matmuls(self.plan, packed, self.large, self.most_rows)

    @property
    def packed_bytes(self) -> int:
        return weight_bytes(self.packed)

    def describe(self) -> dict[str, str]:
        """Each planned row count and how it is computed (none: ``F.linear`` for every step)."""
        out = {str(rows): f"{FORMS[form]} over {padded} rows" for rows, (form, padded) in sorted(self.plan.items())}
        counts = sorted(self.large)
        if len(set(self.large.values())) == 1:
            if counts and self.large[counts[0]] != LINEAR:
                out[f">{self.most_rows}"] = FORMS[self.large[counts[0]]]
            return out
        low = self.most_rows + 1
        for at, measured in enumerate(counts):  # each measured count's range: "9-32", "33+"
            if at + 1 == len(counts):
                out[f"{low}+"] = FORMS[self.large[measured]]
            else:
                high = math.isqrt(measured * counts[at + 1])
                out[f"{low}-{high}"] = FORMS[self.large[measured]]
                low = high + 1
        return out


def plan_from_costs(costs: Mapping[int, Sequence[float]]) -> dict[int, tuple[int, int]]:
    """From each measured row count's seconds per form (``F.linear``, ``W @ xᵀ``, and packed where measured):
    for every row count, the cheapest form and number of rows to compute (its own, or more with zero rows),
    where that beats ``F.linear`` at its own count by over ``MIN_GAIN``."""
    plan: dict[int, tuple[int, int]] = {}
    for rows, own in costs.items():
        options = [
            (seconds, (form, more))
            for more, forms in costs.items()
            if more >= rows
            for form, seconds in enumerate(forms)
        ]
        seconds, how = min(options)
        if seconds < (1 - MIN_GAIN) * own[LINEAR]:
            plan[rows] = how
    return plan


def large_forms(costs: Mapping[int, tuple[float, float]]) -> dict[int, int]:
    """From each large row count's (``F.linear``, packed) seconds, its form: ``PACKED`` where it beat ``F.linear``
    by over ``MIN_GAIN`` there.  Each count decides for the steps nearest it: one form for all larger steps, packed
    only where it won at every count, gave a Qwen2.5-0.5B stage in bfloat16 F.linear at 16 rows (2.3x its blocks'
    time, a decode step 1.9x) whenever 64 rows came out even, on a node busy while it loaded."""
    return {rows: PACKED if packed < (1 - MIN_GAIN) * plain else LINEAR for rows, (plain, packed) in costs.items()}


def widest_form(plan: Plan, small: Mapping[int, Sequence[float]]) -> int:
    """The form for larger steps when none of ``LARGE_ROWS`` was timed within the probe's budget (a node busy
    while it loads: several stages and the ingress starting at once): the widest timed step's, packed only if it
    won there.  F.linear for every larger step instead cost a Qwen2.5-0.5B stage in bfloat16 2.3x its blocks'
    time at 16 rows, for as long as the service ran, where the packed form wins at every row count."""
    widest = max(small, default=0)
    return PACKED if widest and plan.get(widest, (LINEAR, widest))[0] == PACKED else LINEAR


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
    """``step``'s seconds: with one torch thread, the CPU time of this thread, which computes it all; with more, the
    wall.  A stage loads while its node's other processes start (the ingress, Serve's proxy, the model's other
    stages), and a container at its CPU quota is stopped for the rest of each scheduler period: wall timings there
    caught those pauses (and on a 1.0-CPU lab host, 16-row steps planned as F.linear, at 2.3x the packed form's
    cost, for as long as the service ran), where the thread's CPU time does not count them."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    began = clock()
    step()
    return clock() - began


def _probe_part(linear: nn.Linear, most_bytes: int) -> nn.Linear:
    """``linear``, or for a matrix larger than ``most_bytes`` (a large vocabulary's head: 272 MB at Qwen2.5-0.5B's
    in bfloat16) its first output rows within them, a view: a form's cost per byte is the same over the part,
    and timing the whole would spend the probe's budget on a few row counts (the larger steps never measured)."""
    row_bytes = linear.in_features * linear.weight.element_size()
    keep = max(1, most_bytes // row_bytes)
    if keep >= linear.out_features:
        return linear
    part = nn.Linear(linear.in_features, keep, bias=linear.bias is not None, device="meta")
    part.weight = nn.Parameter(linear.weight.detach()[:keep], requires_grad=False)
    if linear.bias is not None:
        part.bias = nn.Parameter(linear.bias.detach()[:keep], requires_grad=False)
    return part


def measure(
    linears: Sequence[nn.Linear],
    *,
    most_rows: int = MOST_ROWS,
    budget_s: float = PROBE_BUDGET_S,
    spare_bytes: int | None = None,
) -> Matmuls:
    """Time each form for 1..``most_rows`` rows, then ``F.linear`` and packed for ``LARGE_ROWS``, over
    ``linears`` (a stage's matrices, at most ``PROBE_BYTES`` of them), each ``REPEATS`` times alternately
    after a warm-up, the cache flushed before every timing; the row counts not reached within ``budget_s``
    keep ``F.linear``.  The packed form is measured only where oneDNN has it for the dtype and a packed copy
    of all of ``linears`` fits ``spare_bytes`` (None: no limit); the copy is kept only if the plan uses it.
    CPU only."""
    chosen: list[nn.Linear] = []
    total = 0
    for linear in linears:
        if total >= PROBE_BYTES:
            break
        chosen.append(_probe_part(linear, PROBE_BYTES - total))
        total += weight_bytes([chosen[-1]])
    if not chosen:
        return Matmuls()
    dtype = chosen[0].weight.dtype
    with torch.inference_mode():
        packed = (
            {m: pack(m.weight) for m in chosen}
            if packable(dtype) and (spare_bytes is None or weight_bytes(linears) <= spare_bytes)
            else {}
        )
        forms = (LINEAR, FLIPPED, PACKED) if packed else (LINEAR, FLIPPED)
        flush = torch.zeros(min(2 * cache_bytes(), 512 * 2**20) // 4, dtype=torch.float32)
        began = time.perf_counter()

        def costs_of(rows: int, forms: Sequence[int]) -> tuple[float, ...]:
            inputs = [torch.randn(rows, m.in_features, dtype=dtype) for m in chosen]
            pairs = list(zip(inputs, chosen, strict=True))

            def run(form: int) -> float:
                flush.add_(1.0)  # every cache line of the flush buffer touched: the weights are evicted
                return _timed(lambda: [_product(m, x, form, rows, packed) for x, m in pairs])

            for form in forms:  # warm up: first touches, the libraries' own set-up for the shape
                run(form)
            samples = [[run(form) for form in forms] for _ in range(REPEATS)]
            return tuple(min(s[i] for s in samples) for i in range(len(forms)))

        small: dict[int, tuple[float, ...]] = {}
        for rows in range(1, most_rows + 1):
            if time.perf_counter() - began > budget_s:
                break
            small[rows] = costs_of(rows, forms)
        large: dict[int, tuple[float, float]] = {}
        if packed:
            for rows in LARGE_ROWS:
                if time.perf_counter() - began > 2 * budget_s:
                    break
                plain_s, packed_s = costs_of(rows, (LINEAR, PACKED))
                large[rows] = (plain_s, packed_s)
        plan = plan_from_costs(small)
        large_how = large_forms(large) if large else {most_rows + 1: widest_form(plan, small)}
        if PACKED in {form for form, _ in plan.values()} | set(large_how.values()):
            packed = {m: packed[m] if m in packed else pack(m.weight) for m in linears}  # not a probe's part
        else:
            packed = {}
    return Matmuls(plan, packed, large_how, most_rows)
