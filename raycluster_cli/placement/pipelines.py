"""Where the pipelines run: nodes grouped into replicas, each replica's blocks split by measured speed.

Pure Python (no Ray, no torch), so the choices are tested on their own.  Each node comes with its
measured cost of every unit (``node.stage_worker.unit_cost_row`` of its calibration).  With N nodes and
S stages per pipeline there are floor(N/S) replicas (``--replicas`` may ask for fewer); the nodes
are ranked fastest first and dealt to the replicas in snake order (0, 1, .., R-1, R-1, .., 0, ..), so
every replica gets a like mix of fast and slow nodes and the replicas' throughputs match: a router
that balances outstanding work then keeps them equally busy.  Each replica's blocks are split by
the bench's exact min-max DP (``balanced_partition``) over its own nodes' costs, so its slowest
stage is as fast as it can be.  A pipeline that lost a node is re-planned over its survivors plus
any free node (``replan``), with fewer stages when there are fewer nodes.  A serving pipeline whose stages
measure, under load, otherwise than their calibration said (a node that shares its CPU with the ingress, Ray's own
processes or a neighbour) is re-split from those measurements (``resplit``) when that makes its slowest stage
markedly faster.

Memory is a hard limit: given each unit's bytes (weights at the dtype + the KV cache slots of a block,
``placement.memory.demand``) and each node's ``capacity``, a split never puts more on a node than it holds,
however fast the node; a replica that cannot fit is refused with the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from raycluster_cli.placement.partition import DoesNotFit, balanced_partition, blocks_held, stage_costs

REBALANCE_GAIN = 0.15  # a re-split is worth building a new pipeline when its slowest stage is this much faster


@dataclass(frozen=True)
class NodeSpeed:
    """One node and its measured seconds per unit (embedding, each block, head) for a serving step."""

    node_id: str  # "" = anywhere (unpinned: tests and single-node runs)
    ip: str
    unit_costs: tuple[float, ...]
    capacity: int | None = None  # bytes a stage may take on this node (after its fixed step bytes); None: not measured

    @property
    def block_s(self) -> float:
        return self.unit_costs[1] if len(self.unit_costs) > 2 else 0.0


@dataclass(frozen=True)
class PipelinePlan:
    """One replica: stage i holds units ``ranges[i]`` on node ``node_ids[i]``; ``why`` says how it was chosen."""

    node_ids: tuple[str, ...]
    ips: tuple[str, ...]
    ranges: tuple[tuple[int, int], ...]
    stage_s: tuple[float, ...] = ()  # modelled seconds of each stage per step (empty: not measured)
    why: str = ""

    @property
    def stages(self) -> int:
        return len(self.ranges)

    def to_json(self, num_blocks: int) -> dict[str, Any]:
        """The replica as the launcher reports it: each stage's units, block count, node and modelled cost."""
        stages = [
            {
                "units": [start, end],
                "blocks": blocks_held(start, end, num_blocks),
                "node_ip": ip,
                "node_id": node,
                **({"stage_s": round(self.stage_s[i], 6)} if self.stage_s else {}),
            }
            for i, ((start, end), node, ip) in enumerate(zip(self.ranges, self.node_ids, self.ips, strict=True))
        ]
        return {"stages": stages, "why": self.why}


def snake_groups(nodes: Sequence[NodeSpeed], replicas: int, stages: int) -> list[list[NodeSpeed]]:
    """``replicas`` groups of ``stages`` nodes, fastest first, dealt in snake order; slower extras stay out."""
    ranked = sorted(nodes, key=lambda n: (sum(n.unit_costs), n.ip, n.node_id))[: replicas * stages]
    groups: list[list[NodeSpeed]] = [[] for _ in range(replicas)]
    for index, node in enumerate(ranked):
        turn, pos = divmod(index, replicas)
        groups[pos if turn % 2 == 0 else replicas - 1 - pos].append(node)
    return groups


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f} GB"


def _memory(
    nodes: Sequence[NodeSpeed], unit_bytes: Sequence[int] | None
) -> tuple[list[float] | None, list[float] | None]:
    """The partition's memory arguments: only when the units' bytes and every node's capacity are known."""
    capacities = [n.capacity for n in nodes]
    if unit_bytes is None or not nodes or None in capacities:
        return None, None
    return [float(b) for b in unit_bytes], [float(c or 0) for c in capacities]


def _check_fits(
    nodes: Sequence[NodeSpeed], ranges: Sequence[tuple[int, int]], unit_bytes: Sequence[int] | None
) -> None:
    sizes, room = _memory(nodes, unit_bytes)
    if sizes is None or room is None:
        return
    for i, (start, end) in enumerate(ranges):
        if sum(sizes[start:end]) > room[i]:
            raise DoesNotFit(
                f"stage {i} (units {start}-{end - 1}) needs {_gb(sum(sizes[start:end]))} but {nodes[i].ip} holds"
                f" {_gb(room[i])}: choose another --split, --dtype bfloat16 or fewer --slots"
            )


def split_over(
    nodes: Sequence[NodeSpeed],
    split: Sequence[tuple[int, int]] | None = None,
    why: str = "",
    unit_bytes: Sequence[int] | None = None,
) -> PipelinePlan:
    """One pipeline over ``nodes`` in order: the given unit ranges, else the min-max split of their costs;
    with ``unit_bytes`` (and every node's capacity) no stage holds more than its node can."""
    rows = [list(n.unit_costs) for n in nodes]
    measured = all(rows) and all(len(r) == len(rows[0]) for r in rows)
    sizes, room = _memory(nodes, unit_bytes)
    if split is not None:
        ranges = [(int(a), int(b)) for a, b in split]
        _check_fits(nodes, ranges, unit_bytes)
        reason = why or "the split given by --split"
    elif measured:
        try:
            ranges = balanced_partition(rows, unit_bytes=sizes, capacity=room)
        except DoesNotFit:
            total = sum(sizes or [])
            raise DoesNotFit(
                f"the model ({_gb(total)} with its KV cache) does not fit {len(nodes)} stage(s) on "
                + ", ".join(f"{n.ip} {_gb(n.capacity or 0)}" for n in nodes)
            ) from None
        reason = (
            why
            or "blocks split by each node's measured block cost (min-max: the slowest stage is as fast as it can be)"
        )
    else:
        raise ValueError("a balanced split needs every node's measured unit costs")
    costs = tuple(stage_costs(rows, ranges)) if measured else ()
    return PipelinePlan(
        node_ids=tuple(n.node_id for n in nodes),
        ips=tuple(n.ip for n in nodes),
        ranges=tuple((int(a), int(b)) for a, b in ranges),
        stage_s=costs,
        why=reason,
    )


def plan_replicas(
    nodes: Sequence[NodeSpeed],
    stages: int,
    replicas: int = 0,
    split: Sequence[tuple[int, int]] | None = None,
    unit_bytes: Sequence[int] | None = None,
) -> list[PipelinePlan]:
    """floor(N/S) replicas (or ``replicas``, at most that), each split over its nodes' measured costs and
    within their memory (``unit_bytes``: each unit's bytes; see ``split_over``)."""
    if stages < 1:
        raise ValueError(f"need at least one stage, got {stages}")
    most = len(nodes) // stages
    if most < 1:
        raise ValueError(f"{len(nodes)} alive node(s) cannot hold a pipeline of {stages} stages")
    count = min(replicas, most) if replicas > 0 else most
    left = len(nodes) - count * stages
    why = (
        f"{len(nodes)} node(s), {stages} stage(s) per pipeline: {count} replica(s)"
        + (f", {left} slowest node(s) unused" if left else "")
        + "; nodes dealt fastest first in snake order so the replicas match in speed; "
    )
    groups = snake_groups(nodes, count, stages)
    if split is not None:
        return [
            split_over(group, split, why + "each replica uses the split given by --split", unit_bytes)
            for group in groups
        ]
    text = why + "each replica's blocks split by its nodes' measured block costs (min-max)"
    if unit_bytes is not None and all(n.capacity is not None for n in nodes):
        text += " within each node's memory"
    return [split_over(group, None, text, unit_bytes) for group in groups]


def replan(
    survivors: Sequence[NodeSpeed],
    free: Sequence[NodeSpeed],
    stages: int,
    num_blocks: int,
    unit_bytes: Sequence[int] | None = None,
) -> PipelinePlan | None:
    """A pipeline for a replica that lost nodes: its surviving nodes first, then the fastest free ones, up
    to ``stages`` (never more stages than blocks); None when no node is left."""
    extra = sorted(free, key=lambda n: sum(n.unit_costs))
    nodes = [*survivors, *extra][: min(stages, num_blocks)]
    if not nodes:
        return None
    why = (
        f"re-split over {len(nodes)} node(s) ({len(survivors)} surviving, {len(nodes) - min(len(survivors), len(nodes))}"
        " free) by their measured block costs (min-max)"
    )
    return split_over(nodes, None, why, unit_bytes)


def resplit(
    plan: PipelinePlan,
    speeds: Sequence[NodeSpeed],
    measured: Sequence[float],
    unit_bytes: Sequence[int] | None = None,
) -> tuple[PipelinePlan, list[NodeSpeed]] | None:
    """``plan`` re-split from its stages' measured seconds per step under load, with the nodes' corrected costs;
    None when the split stays or gains less than ``REBALANCE_GAIN`` on its slowest stage.

    ``speeds`` are the plan's nodes in stage order (their calibrated costs).  Each node's costs are scaled by its
    stage's measured ÷ modelled seconds, relative to the least slowed stage (a batch larger than the calibration's
    slows every stage alike and moves nothing); the min-max split over the corrected costs is then compared with
    the measured slowest stage.  With ``unit_bytes`` and the nodes' capacities, the new stage must fit its node
    beside the old one (the new pipeline is built before the old one drains)."""
    if plan.stages < 2 or len(plan.stage_s) != plan.stages or len(measured) != plan.stages:
        return None
    if any(p <= 0 for p in plan.stage_s) or any(m <= 0 for m in measured):
        return None
    ratios = [m / p for m, p in zip(measured, plan.stage_s, strict=True)]
    factors = [r / min(ratios) for r in ratios]
    now = max(f * p for f, p in zip(factors, plan.stage_s, strict=True))
    corrected = [
        NodeSpeed(n.node_id, n.ip, tuple(c * f for c in n.unit_costs), n.capacity)
        for n, f in zip(speeds, factors, strict=True)
    ]
    beside = corrected
    if unit_bytes is not None and all(n.capacity is not None for n in corrected):
        held = [sum(unit_bytes[a:b]) for a, b in plan.ranges]
        beside = [
            NodeSpeed(n.node_id, n.ip, n.unit_costs, (n.capacity or 0) - h)
            for n, h in zip(corrected, held, strict=True)
        ]
    slowed = ", ".join(f"{n.ip or i} x{f:.2f}" for i, (n, f) in enumerate(zip(speeds, factors, strict=True)))
    why = f"re-split from the stages' seconds per step measured under load (relative slowdown: {slowed})"
    try:
        new = split_over(beside, None, why, unit_bytes)
    except DoesNotFit:
        return None
    if new.ranges == plan.ranges or max(new.stage_s) > (1.0 - REBALANCE_GAIN) * now:
        return None
    gain = f"; slowest stage {1.0 - max(new.stage_s) / now:.0%} faster by the corrected costs"
    return replace(new, why=why + gain), corrected
