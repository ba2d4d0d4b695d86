"""Where the pipelines run: nodes grouped into replicas, each replica's blocks split by measured speed.

Pure Python (no Ray, no torch), so the choices are tested on their own.  Each node comes with its
measured cost of every unit (``bench.pipeline.unit_cost_row`` of its calibration).  With N nodes and
S stages per pipeline there are floor(N/S) replicas (``--replicas`` may ask for fewer); the nodes
are ranked fastest first and dealt to the replicas in snake order (0, 1, .., R-1, R-1, .., 0, ..), so
every replica gets a like mix of fast and slow nodes and the replicas' throughputs match: a router
that balances outstanding work then keeps them equally busy.  Each replica's blocks are split by
the bench's exact min-max DP (``balanced_partition``) over its own nodes' costs, so its slowest
stage is as fast as it can be.  A pipeline that lost a node is re-planned over its survivors plus
any free node (``replan``), with fewer stages when there are fewer nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raycluster_cli.bench.partition import balanced_partition, blocks_held, stage_costs


@dataclass(frozen=True)
class NodeSpeed:
    """One node and its measured seconds per unit (embedding, each block, head) for a serving step."""

    node_id: str  # "" = anywhere (unpinned: tests and single-node runs)
    ip: str
    unit_costs: tuple[float, ...]

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


def split_over(
    nodes: Sequence[NodeSpeed], split: Sequence[tuple[int, int]] | None = None, why: str = ""
) -> PipelinePlan:
    """One pipeline over ``nodes`` in order: the given unit ranges, else the min-max split of their costs."""
    rows = [list(n.unit_costs) for n in nodes]
    measured = all(rows) and all(len(r) == len(rows[0]) for r in rows)
    if split is not None:
        ranges = [(int(a), int(b)) for a, b in split]
        reason = why or "the split given by --split"
    elif measured:
        ranges = balanced_partition(rows)
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
) -> list[PipelinePlan]:
    """floor(N/S) replicas (or ``replicas``, at most that), each split over its nodes' measured costs."""
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
        return [split_over(group, split, why + "each replica uses the split given by --split") for group in groups]
    return [
        split_over(group, None, why + "each replica's blocks split by its nodes' measured block costs (min-max)")
        for group in groups
    ]


def replan(
    survivors: Sequence[NodeSpeed], free: Sequence[NodeSpeed], stages: int, num_blocks: int
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
    return split_over(nodes, None, why)
