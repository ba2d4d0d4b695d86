"""How to cut the model's units into contiguous pipeline stages.  Pure Python, no torch.

Units are 0 (embedding), 1..L (blocks) and L+1 (final norm + LM head); a partition is a list of
half-open unit ranges ``(start, end)``, one per stage, that tile 0..L+2 in order, so stage 0 always
holds the embedding and the last stage the head.  Every function returns ranges with at least one
block per stage (the balanced one can be asked for less) and raises ``ValueError`` otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

Ranges = list[tuple[int, int]]

_REL_TOL = 1e-9


class DoesNotFit(ValueError):
    """No split keeps every stage within its node's memory."""


def _check_counts(num_blocks: int, num_stages: int) -> None:
    if num_blocks < 1:
        raise ValueError(f"the model needs at least one block, got {num_blocks}")
    if num_stages < 1:
        raise ValueError(f"need at least one stage, got {num_stages}")
    if num_stages > num_blocks:
        raise ValueError(
            f"cannot split {num_blocks} blocks into {num_stages} stages: more stages than blocks "
            "(use fewer stages or a deeper model)"
        )


def ranges_from_block_counts(counts: Sequence[int]) -> Ranges:
    """Unit ranges for stages holding ``counts[i]`` blocks each; embedding/head ride on the ends."""
    ranges: Ranges = []
    start = 0
    num_blocks = sum(counts)
    for index, count in enumerate(counts):
        end = start + count + (1 if index == 0 else 0)
        if index == len(counts) - 1:
            end = num_blocks + 2
        ranges.append((start, end))
        start = end
    return ranges


def even_partition(num_blocks: int, num_stages: int) -> Ranges:
    """Blocks split as evenly as possible (earlier stages take the remainder)."""
    _check_counts(num_blocks, num_stages)
    base, extra = divmod(num_blocks, num_stages)
    return ranges_from_block_counts([base + (1 if i < extra else 0) for i in range(num_stages)])


def parse_block_counts(text: str) -> list[int]:
    """``"4,4,4"`` -> ``[4, 4, 4]``."""
    parts = [p.strip() for p in text.split(",")]
    try:
        counts = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"manual partition must be comma-separated block counts like 4,4,4, got {text!r}") from None
    return counts


def manual_partition(counts: Sequence[int] | str, num_blocks: int | None = None) -> Ranges:
    """Stages with the given block counts, e.g. ``[4, 4, 4]`` or ``"4,4,4"``.

    When ``num_blocks`` is given the counts must add up to it.
    """
    parsed = parse_block_counts(counts) if isinstance(counts, str) else [int(c) for c in counts]
    if not parsed:
        raise ValueError("manual partition needs at least one stage")
    bad = [c for c in parsed if c < 1]
    if bad:
        raise ValueError(f"every stage needs at least one block, got counts {parsed}")
    if num_blocks is not None and sum(parsed) != num_blocks:
        raise ValueError(f"manual partition {parsed} holds {sum(parsed)} blocks but the model has {num_blocks}")
    return ranges_from_block_counts(parsed)


def _transfer_list(transfer_cost: float | Sequence[float], num_stages: int) -> list[float]:
    """Per-stage cost of sending its output on to the next stage (0 for the last stage)."""
    if isinstance(transfer_cost, int | float):
        costs = [float(transfer_cost)] * (num_stages - 1)
    else:
        costs = [float(c) for c in transfer_cost]
        if len(costs) != num_stages - 1:
            raise ValueError(f"transfer_cost needs one value per stage boundary ({num_stages - 1}), got {len(costs)}")
    if any(c < 0 for c in costs):
        raise ValueError("transfer costs must be >= 0")
    return [*costs, 0.0]


def _fixed_list(fixed_cost: Sequence[float] | None, num_stages: int) -> list[float]:
    if fixed_cost is None:
        return [0.0] * num_stages
    costs = [float(c) for c in fixed_cost]
    if len(costs) != num_stages:
        raise ValueError(f"fixed_cost needs one value per stage ({num_stages}), got {len(costs)}")
    if any(c < 0 for c in costs):
        raise ValueError("fixed costs must be >= 0")
    return costs


def boundary_costs(transfer: float, num_stages: int) -> list[float]:
    """Per-stage share of moving activations across stage boundaries, ``transfer`` per boundary.

    Both ends of a boundary work on a transfer (one serialises, the other deserialises), so each
    pays half: the first and last stage touch one boundary, the middle ones two.
    """
    if transfer < 0:
        raise ValueError("transfer cost must be >= 0")
    return [transfer / 2 * ((s > 0) + (s < num_stages - 1)) for s in range(num_stages)]


def stage_costs(
    unit_costs_per_stage_node: Sequence[Sequence[float]],
    ranges: Sequence[tuple[int, int]],
    transfer_cost: float | Sequence[float] = 0.0,
    fixed_cost: Sequence[float] | None = None,
) -> list[float]:
    """Modelled time of each stage: its units' cost on its own node, sending its output, fixed costs."""
    transfer = _transfer_list(transfer_cost, len(ranges))
    fixed = _fixed_list(fixed_cost, len(ranges))
    return [
        sum(unit_costs_per_stage_node[s][start:end]) + transfer[s] + fixed[s] for s, (start, end) in enumerate(ranges)
    ]


def _checked_costs(rows: Sequence[Sequence[float]], min_blocks_per_stage: int) -> list[list[float]]:
    """The cost rows as floats, refused when no split of them can exist."""
    costs = [[float(c) for c in row] for row in rows]
    num_stages = len(costs)
    if num_stages < 1:
        raise ValueError("need at least one stage (one cost row per stage node)")
    num_units = len(costs[0])
    if any(len(row) != num_units for row in costs):
        raise ValueError("every stage node needs a cost for every unit (rows of equal length)")
    if num_units < 3:
        raise ValueError(f"need embedding, at least one block and head: got {num_units} units")
    if any(c < 0 for row in costs for c in row):
        raise ValueError("unit costs must be >= 0")
    if min_blocks_per_stage < 0:
        raise ValueError("min_blocks_per_stage must be >= 0")
    num_blocks = num_units - 2
    if min_blocks_per_stage >= 1:
        _check_counts(num_blocks, num_stages)
        if num_stages * min_blocks_per_stage > num_blocks:
            raise ValueError(
                f"cannot give {num_stages} stages {min_blocks_per_stage} blocks each: the model has {num_blocks}"
            )
    elif num_stages > num_units:
        raise ValueError(f"cannot split {num_units} units into {num_stages} non-empty stages")
    return costs


def _memory_rows(
    unit_bytes: Sequence[float] | None, capacity: Sequence[float] | None, num_units: int, num_stages: int
) -> tuple[list[float], list[float]] | None:
    if unit_bytes is None and capacity is None:
        return None
    if unit_bytes is None or capacity is None:
        raise ValueError("unit_bytes and capacity go together")
    if len(unit_bytes) != num_units or len(capacity) != num_stages:
        raise ValueError(f"need {num_units} unit sizes and {num_stages} capacities")
    prefix = [0.0]
    for size in unit_bytes:
        prefix.append(prefix[-1] + float(size))
    return prefix, [float(c) for c in capacity]


def balanced_partition(
    unit_costs_per_stage_node: Sequence[Sequence[float]],
    transfer_cost: float | Sequence[float] = 0.0,
    min_blocks_per_stage: int = 1,
    fixed_cost: Sequence[float] | None = None,
    unit_bytes: Sequence[float] | None = None,
    capacity: Sequence[float] | None = None,
) -> Ranges:
    """Exact min-max split of the units over S stages where stage s runs on node s.

    ``unit_costs_per_stage_node[s][u]`` is the cost of unit ``u`` on the node of stage ``s`` (all rows
    the same length L+2, nodes may differ in speed).  ``transfer_cost`` is one number for every
    stage boundary or a list with one value per boundary (stage s -> s+1); it is charged to the
    sending stage; ``fixed_cost`` adds one number per stage whatever it holds (e.g. its share of
    the transfers, ``boundary_costs``).  The steady-state throughput of a pipeline is set by its slowest stage, so the
    split minimises the maximum stage cost; among the optimal splits it picks the one with the
    smallest sum of squared stage costs (the most even one), found by a second exact DP under the
    optimal bound.  O(S * U^2), trivial for any realistic model.  The DP is kept whole (one nested
    solver over shared prefix sums), as it reads better that way than split into pieces.

    Memory is a hard constraint: with ``unit_bytes`` (what each unit takes, e.g. weights + KV cache) and
    ``capacity`` (what each stage's node can hold, per stage, after any fixed per-stage bytes), a stage
    whose units exceed its capacity is never considered, however fast; ``DoesNotFit`` when no split fits.
    """
    costs = _checked_costs(unit_costs_per_stage_node, min_blocks_per_stage)
    num_stages, num_units = len(costs), len(costs[0])
    transfer = _transfer_list(transfer_cost, num_stages)
    fixed = _fixed_list(fixed_cost, num_stages)
    memory = _memory_rows(unit_bytes, capacity, num_units, num_stages)

    prefix = [[0.0] for _ in range(num_stages)]
    for s in range(num_stages):
        for c in costs[s]:
            prefix[s].append(prefix[s][-1] + c)

    def blocks_in(start: int, end: int) -> int:
        return max(0, min(end, num_units - 1) - max(start, 1))

    def cost(s: int, start: int, end: int) -> float:
        return prefix[s][end] - prefix[s][start] + transfer[s] + fixed[s]

    def valid(s: int, start: int, end: int) -> bool:
        if end <= start or blocks_in(start, end) < min_blocks_per_stage:
            return False
        if memory is not None and memory[0][end] - memory[0][start] > memory[1][s]:
            return False
        return (s == num_stages - 1) == (end == num_units)

    inf = float("inf")

    def solve(score: str, bound: float) -> Ranges:
        # best[s][u]: best score with stages 0..s covering units [0, u); choice[s][u]: start of stage s.
        best = [[inf] * (num_units + 1) for _ in range(num_stages)]
        choice = [[-1] * (num_units + 1) for _ in range(num_stages)]
        for s in range(num_stages):
            for end in range(1, num_units + 1):
                for start in range(0, end):
                    if not valid(s, start, end):
                        continue
                    prev = 0.0 if s == 0 else best[s - 1][start]
                    if (s == 0) != (start == 0) or prev == inf:
                        continue
                    c = cost(s, start, end)
                    if score == "max":
                        value = max(prev, c)
                    else:
                        if c > bound:
                            continue
                        value = prev + c * c
                    if value < best[s][end]:
                        best[s][end] = value
                        choice[s][end] = start
        if best[num_stages - 1][num_units] == inf:
            if memory is not None:
                raise DoesNotFit(
                    f"no split of {num_units} units into {num_stages} stages fits the nodes' memory: the units take"
                    f" {memory[0][-1] / 1e9:.2f} GB, the stages' nodes hold "
                    + ", ".join(f"{c / 1e9:.2f} GB" for c in memory[1])
                )
            raise ValueError(f"no valid split of {num_units} units into {num_stages} stages")
        ranges: Ranges = []
        end = num_units
        for s in range(num_stages - 1, -1, -1):
            start = choice[s][end]
            ranges.append((start, end))
            end = start
        ranges.reverse()
        return ranges

    optimal = solve("max", inf)
    bound = max(stage_costs(costs, optimal, transfer[:-1], fixed))
    return solve("sumsq", bound * (1 + _REL_TOL) + 1e-15)


def blocks_held(start: int, end: int, num_blocks: int) -> int:
    """How many transformer blocks the unit range [start, end) contains."""
    return max(0, min(end, num_blocks + 1) - max(start, 1))
