"""Memory as a hard capacity: what each unit of the model takes at its dtype, what each node can hold.

A stage on a node needs its units' weights (at ``cfg.dtype``), the KV cache of its blocks for every row
in flight (micro-batch x micro-batches in flight, each sized to ``max_seq``) and, while it computes, the
activations of one step plus the raw tensors of one unit being read from the checkpoint.  A node's
capacity is what its container may still take: the cgroup memory limit (v2 ``memory.max``, v1
``memory.limit_in_bytes``; times Ray's memory-monitor threshold, 95 %, above which Ray kills workers) less the
working set already there (Ray's processes, the stage worker with torch
loaded; page cache is not counted, as Ray's memory monitor does not count it), or the host's available memory without a limit;
on a GPU node the GPU's free memory.  A margin (``MARGIN``) stays free for what the estimate does not see.

Pure arithmetic; ``cgroup.node_capacity`` measures a node.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from raycluster_cli.models.config import ModelConfig
from raycluster_cli.placement.partition import DoesNotFit

MIB = 1 << 20
GB = 1e9
MARGIN_FRACTION = 0.03  # of the limit (or of what is available) ...
MARGIN_MIN = 48 * MIB  # ... but never less than this


class ModelTooLarge(DoesNotFit):
    """The model (or a split of it) does not fit the nodes' memory; the message has the numbers."""


def gb(value: float) -> str:
    return f"{value / GB:.2f} GB"


def _linear(inputs: int, outputs: int, bias: bool) -> int:
    return inputs * outputs + (outputs if bias else 0)


def block_values(cfg: ModelConfig) -> int:
    """Parameters and buffers of one block (as the Stage builds it)."""
    d = cfg.d_model
    if cfg.arch == "gpt2":
        return (
            2 * 2 * d
            + _linear(d, 3 * d, True)
            + _linear(d, d, True)
            + _linear(d, 4 * d, True)
            + _linear(4 * d, d, True)
        )
    width, heads, kv = cfg.dim_per_head, cfg.heads, cfg.num_kv_heads
    qkv_bias = cfg.attention_bias or cfg.qkv_bias
    attention = _linear(d, heads * width, qkv_bias) + 2 * _linear(d, kv * width, qkv_bias)
    attention += _linear(heads * width, d, cfg.attention_bias)
    mlp = 2 * _linear(d, cfg.mlp_width, cfg.mlp_bias) + _linear(cfg.mlp_width, d, cfg.mlp_bias)
    rotary = 2 * cfg.max_seq * cfg.rotary_width  # cos and sin tables
    return 2 * d + attention + mlp + rotary


def unit_bytes(cfg: ModelConfig) -> list[int]:
    """Bytes of every unit's weights at ``cfg.dtype``: embedding, each block, head (its own LM head matrix,
    also when tied: every stage holds its own copy)."""
    d, size = cfg.d_model, cfg.dtype_bytes
    embedding = cfg.vocab * d + (cfg.max_seq * d if cfg.arch == "gpt2" else 0)
    head = d * (2 if cfg.arch == "gpt2" else 1) + cfg.vocab * d
    return [embedding * size, *([block_values(cfg) * size] * cfg.layers), head * size]


def kv_bytes_per_block(cfg: ModelConfig, rows: int) -> int:
    """K and V of one block for ``rows`` sequences of ``max_seq`` positions."""
    return cfg.kv_bytes(rows * cfg.max_seq)


def step_bytes(cfg: ModelConfig, rows: int, tokens: int, step_tokens: int = 0) -> int:
    """A generous bound on one step's transient tensors in a stage: hidden states, q/k/v, the MLP's
    intermediates, attention scores (float32) and the head's logits of the last position.  ``step_tokens``: the
    most tokens the steps carry in all (the service's scheduler caps a step's), when fewer than rows x tokens."""
    carried = min(rows * tokens, step_tokens) if step_tokens else rows * tokens
    values = carried * (8 * cfg.d_model + 3 * cfg.mlp_width) * cfg.dtype_bytes
    scores = cfg.heads * carried * cfg.max_seq * 4
    return values + scores + rows * cfg.vocab * 4


@dataclass(frozen=True)
class Demand:
    """What holding a model takes: per-unit bytes (weights + KV of blocks) and per-stage fixed bytes."""

    units: tuple[int, ...]  # weights, plus the KV cache for a block
    weights: tuple[int, ...]
    fixed: int  # one step's activations + the largest raw tensor while the checkpoint is read
    rows: int  # rows in flight the KV cache is sized for
    dtype: str

    def stage(self, start: int, end: int) -> int:
        return sum(self.units[start:end]) + self.fixed

    @property
    def total(self) -> int:
        return sum(self.units) + self.fixed

    def describe(self) -> str:
        weights = sum(self.weights)
        kv = sum(self.units) - weights
        return f"{gb(self.total)} ({self.dtype} weights {gb(weights)} + KV cache {gb(kv)} for {self.rows} rows + step {gb(self.fixed)})"


def demand(
    cfg: ModelConfig,
    rows: int,
    tokens: int,
    stored_bytes: int | None = None,
    kv_tokens: int = 0,
    step_tokens: int = 0,
) -> Demand:
    """The model's memory demand for ``rows`` sequences in flight and steps of up to ``tokens`` tokens.

    ``stored_bytes`` is the checkpoint's bytes per value (the raw tensor being read); by default the dtype's own.
    ``kv_tokens``: the KV positions the rows share (the service's budget; 0: every row at ``max_seq``);
    ``step_tokens``: the most tokens the steps in flight carry in all (``step_bytes``)."""
    weights = unit_bytes(cfg)
    kv = cfg.kv_bytes(kv_tokens or rows * cfg.max_seq)
    units = [w + (kv if 0 < u < cfg.head_unit else 0) for u, w in enumerate(weights)]
    largest = max(cfg.vocab * cfg.d_model, cfg.d_model * cfg.mlp_width, 3 * cfg.d_model * cfg.d_model)
    raw = largest * (stored_bytes or cfg.dtype_bytes) if cfg.model_path else 0  # one tensor read at a time
    fixed = step_bytes(cfg, max(1, rows), tokens, step_tokens) + raw
    return Demand(tuple(units), tuple(weights), fixed, rows, cfg.dtype)


@dataclass(frozen=True)
class Capacity:
    """What a node can still hold for a stage: ``usable`` bytes (after the margin), and where it came from."""

    node_id: str
    node_ip: str
    usable: int
    limit: int | None  # the container's memory limit, or the GPU's total; None: the host's memory
    used: int  # the working set (or GPU memory in use) when measured
    source: str  # "cgroup v2", "cgroup v1", "host", "cuda"
    cpu_quota: float | None = None  # the container's CPU quota in CPUs, where it has one

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Capacity:
        return cls(**data)


def margin(total: int) -> int:
    return max(MARGIN_MIN, int(total * MARGIN_FRACTION))


def cgroup_capacity(limit_text: str | None, usage_text: str | None, stat_text: str | None) -> tuple[int, int] | None:
    """(limit, working set) from a cgroup's limit, usage and memory.stat; None when there is no limit.

    The working set leaves out file pages (page cache, active or not: the kernel drops it before it would kill),
    as Ray's memory monitor counts it (``ray._private.utils.get_cgroup_used_memory``)."""
    if limit_text is None or usage_text is None or limit_text.strip() in ("", "max"):
        return None
    limit, usage = int(limit_text), int(usage_text)
    if limit >= 1 << 60:  # cgroup v1 writes "unlimited" as a huge number
        return None
    stat = dict(line.split()[:2] for line in (stat_text or "").splitlines() if len(line.split()) >= 2)
    inactive = int(stat.get("total_inactive_file", stat.get("inactive_file", 0)))
    active = int(stat.get("total_active_file", stat.get("active_file", 0)))
    return limit, max(0, usage - inactive - active)


def describe_capacities(capacities: Sequence[Capacity]) -> str:
    return ", ".join(f"{c.node_ip} {gb(c.usable)}" for c in capacities)


def check_fits(need: Demand, capacities: Sequence[Capacity], stages: int) -> None:
    """Refuse, with the numbers, a model that no split over these nodes can hold: more than all of them
    together (each stage also needs its step's room), or a unit larger than any node."""
    caps = sorted((c.usable for c in capacities), reverse=True)[:stages]
    whole = sum(need.units) + need.fixed * len(caps)
    largest_unit = max(need.units) + need.fixed
    if whole > sum(caps) or largest_unit > caps[0]:
        why = (
            f"{gb(whole)} across {len(caps)} stage(s) > {gb(sum(caps))} usable"
            if whole > sum(caps)
            else f"its largest unit needs {gb(largest_unit)} > the largest node's {gb(caps[0])}"
        )
        raise ModelTooLarge(
            f"the model does not fit the nodes' memory: it needs {need.describe()}; usable per node:"
            f" {describe_capacities(capacities)} ({why}); use --dtype bfloat16, a shorter --max-seq or (serve) fewer --slots"
            " (every slot's KV cache is reserved at the full context), more nodes or larger memory limits"
        )


def stage_capacities(capacities: dict[str, Capacity], node_ids: Sequence[str]) -> list[int]:
    """Usable bytes of each stage's node; stages sharing a node split its room evenly."""
    count: dict[str, int] = {}
    for node_id in node_ids:
        count[node_id] = count.get(node_id, 0) + 1
    return [capacities[n].usable // count[n] for n in node_ids]


def fits(need: Demand, ranges: Sequence[tuple[int, int]], capacity: Sequence[int]) -> str | None:
    """None when every stage of ``ranges`` fits its node, else why not (one line, with the numbers)."""
    for s, (start, end) in enumerate(ranges):
        if need.stage(start, end) > capacity[s]:
            return f"stage {s} (units {start}-{end - 1}) needs {gb(need.stage(start, end))} > {gb(capacity[s])} usable"
    return None


def calibration_blocks(need: Demand, capacity: int, wanted: int) -> int:
    """Blocks the calibration may build at once beside the embedding and the head within ``capacity``."""
    if len(need.units) < 3:
        return 1
    room = capacity - need.units[0] - need.units[-1] - need.fixed
    block = max(need.units[1], 1)
    return max(1, min(wanted, math.floor(room / block)))
