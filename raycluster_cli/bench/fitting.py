"""The benchmark's memory plan: each node's measured room, what the model needs, and which splits fit.

``Session`` measures every node once (``cgroup.node_capacity`` in its stage worker) before any weights are
built; ``refuse_if_too_large`` stops a model that no split can hold, with the numbers; ``balanced`` solves
the min-max split under the capacities; ``why_not`` tells the even split or a reference that does not fit
(they are skipped with that reason); ``report`` puts each node's memory use beside its capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from raycluster_cli.bench.options import BenchOptions
from raycluster_cli.models.config import ModelConfig
from raycluster_cli.placement import memory, partition


def measure_rooms(node_ips: dict[str, str], timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Every node's room now, from a light task on each (no torch, no weights): what an early refusal needs.

    It leaves out the stage worker that will start there, so it can only overstate the room: a model refused
    on it is refused rightly, and the stage workers measure again once they are up."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def room(node_id: str, node_ip: str) -> dict[str, Any]:
        from raycluster_cli.node.cgroup import node_capacity

        return node_capacity(node_id, node_ip).to_dict()

    calls = [
        room.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n, soft=False)).remote(n, ip)
        for n, ip in node_ips.items()
    ]
    return list(ray.get(calls, timeout=timeout_s))


def refuse_early(
    options: BenchOptions, cfg: Any, nodes: list[dict[str, Any]], node_ids: list[str], stages: int, gpus: set[str]
) -> None:
    """A model no split can hold is refused before any stage worker starts (a light task per node)."""
    if not set(node_ids) <= gpus:  # GPU memory is measured by the stage workers themselves
        ips = {n["node_id"]: n["node_ip"] for n in nodes if n["node_id"] in set(node_ids)}
        smallest = replace(cfg, dtype="bfloat16") if options.dtype == "auto" else cfg
        MemoryPlan.make(smallest, options, stages, measure_rooms(ips)).refuse_if_too_large(stages)


def rows_in_flight(options: BenchOptions, stages: int) -> int:
    """Sequences a stage may hold KV caches for at once: micro-batch x micro-batches in flight (the asked
    number, else the most the scheduler admits by default: 4 x stages)."""
    return options.micro_batch * (options.in_flight or 4 * stages)


def step_tokens(options: BenchOptions) -> int:
    return options.prefill_chunk or options.prompt_len


@dataclass
class MemoryPlan:
    capacities: dict[str, memory.Capacity]  # node id -> its room, measured before any weights were built
    need: memory.Demand

    @classmethod
    def make(cls, cfg: ModelConfig, options: BenchOptions, stages: int, capacities: list[dict[str, Any]]) -> MemoryPlan:
        caps = {c["node_id"]: memory.Capacity.from_dict(c) for c in capacities}
        return cls(caps, memory.demand(cfg, rows_in_flight(options, stages), step_tokens(options)))

    def for_config(self, cfg: ModelConfig, options: BenchOptions, stages: int) -> MemoryPlan:
        return replace(self, need=memory.demand(cfg, rows_in_flight(options, stages), step_tokens(options)))

    def refuse_if_too_large(self, stages: int) -> None:
        memory.check_fits(self.need, list(self.capacities.values()), stages)

    def stage_room(self, node_ids: list[str]) -> list[int]:
        return memory.stage_capacities(self.capacities, node_ids)

    def balanced(self, cost_rows: list[list[float]], transfer_s: float, node_ids: list[str]) -> partition.Ranges:
        """The min-max split of one replica whose every stage fits its node."""
        room = [max(0, c - self.need.fixed) for c in self.stage_room(node_ids)]
        fixed = partition.boundary_costs(transfer_s, len(cost_rows))
        try:
            return partition.balanced_partition(cost_rows, fixed_cost=fixed, unit_bytes=self.need.units, capacity=room)
        except partition.DoesNotFit:
            raise memory.ModelTooLarge(
                f"no split of the model over {len(node_ids)} stage(s) fits their nodes' memory: it needs"
                f" {self.need.describe()}; usable: {memory.describe_capacities([self.capacities[n] for n in node_ids])}"
            ) from None

    def why_not(self, ranges: list[tuple[int, int]], node_ids: list[str]) -> str | None:
        return memory.fits(self.need, ranges, self.stage_room(node_ids))

    def calibration_blocks(self, node_id: str, wanted: int = 4) -> int:
        return memory.calibration_blocks(self.need, self.capacities[node_id].usable, wanted)

    def report(self, stages: list[dict[str, Any]]) -> dict[str, Any]:
        """Each stage's node: its capacity, what the plan gave the stage, what it held and the container's use."""
        out = []
        for stage in stages:
            cap = self.capacities.get(stage["node_id"])
            start, end = stage["units"]
            out.append(
                {
                    "replica": stage["replica"],
                    "stage": stage["index"],
                    "node_ip": stage["node_ip"],
                    "source": cap.source if cap else None,
                    "limit_bytes": cap.limit if cap else None,
                    "used_before_bytes": cap.used if cap else None,
                    "capacity_bytes": cap.usable if cap else None,
                    "planned_bytes": self.need.stage(start, end),
                    "weights_bytes": stage.get("weights_bytes"),
                    "cache_peak_bytes": stage.get("cache_peak_bytes"),
                    "working_set_bytes": stage.get("working_set_bytes"),
                    "peak_bytes": stage.get("memory_peak_bytes"),  # cgroup's, page cache included
                    "process_peak_rss_bytes": stage.get("process_peak_rss_bytes"),
                }
            )
        need = self.need
        return {
            "dtype": need.dtype,
            "model_bytes": sum(need.weights),
            "kv_bytes_per_block": need.units[1] - need.weights[1] if len(need.units) > 2 else 0,
            "rows_in_flight": need.rows,
            "step_bytes": need.fixed,
            "needs": need.describe(),
            "stages": out,
        }
