"""A decode step's hops through three no-op stages, one per node, over `serve`'s direct links (node.links: a gloo
ring, the driver as the engine) and over Ray's calls (the relay the engine used before), alternated in rounds.

Run on the cluster as a job (its driver is on the head, as `serve`'s ingress is):
  raycluster submit -i INVENTORY --working-dir benchmarks -- python link_hops.py 300
Prints one JSON document: each node's CPU quota; per round and overall, the round trip p50/p90 of a step of
8 KiB (one row's hidden state at d=2048) and per hop (4 hops: driver → 3 stages → driver); each stage's CPU per
step, and its CPU per second while it waits (the links' receive blocks; it does not poll).
"""

import asyncio
import json
import os
import statistics
import sys
import time

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycluster_cli.node.links import MIN_CAPACITY, DirectLinks, StageLoop
from raycluster_cli.node.rendezvous import Joining, form_ring


@ray.remote(num_cpus=0, concurrency_groups={"links": 2})
class NoOpStage:
    def __init__(self) -> None:
        self.loop = None

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x

    @ray.method(concurrency_group="links")
    def offer_links(self, rank: int, size: int) -> dict:
        self.joining = Joining(rank, size, ray.util.get_node_ip_address())
        return self.joining.offer()

    @ray.method(concurrency_group="links")
    def join_links(self, records: dict, secret: bytes, capacity: int) -> None:
        self.group = self.joining.join(records, secret)

    @ray.method(concurrency_group="links")
    def run_links(self) -> None:
        self.loop = StageLoop(self.group, self.joining.rank, self.joining.size, self.forward)
        self.loop.start()

    def cpu(self) -> float:
        t = os.times()
        return t.user + t.system

    def quota(self) -> float | None:
        from raycluster_cli.node.cgroup import container_cpu_quota

        return container_cpu_quota()


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _links_round(links: DirectLinks, x: torch.Tensor, table: torch.Tensor, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        await links.run(x, table)
        times.append(time.perf_counter() - began)
    return times


def _relay_round(stages: list, x: torch.Tensor, table: torch.Tensor, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        ref = x
        for stage in stages:
            ref = stage.forward.remote(ref, table)
        ray.get(ref)
        times.append(time.perf_counter() - began)
    return times


async def main(steps: int, rounds: int) -> dict:
    ray.init()
    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeManagerAddress"])[:3]
    relay = [
        NoOpStage.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in nodes
    ]
    linked = [
        NoOpStage.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in nodes
    ]
    ip = ray.util.get_node_ip_address()
    size = len(linked) + 1
    group = await form_ring(linked, ip, MIN_CAPACITY)
    links = DirectLinks(group, size)
    links.start()
    x = torch.zeros(1, 1, 2048)  # 8 KiB
    table = torch.tensor([[0], [0], [1]])
    _relay_round(relay, x, table, 20)
    await _links_round(links, x, table, 20)
    found: dict[str, list[float]] = {"relay": [], "links": []}
    cpu: dict[str, list[float]] = {"relay": [], "links": []}
    for number in range(rounds):
        for kind in ["relay", "links"] if number % 2 == 0 else ["links", "relay"]:
            actors = relay if kind == "relay" else linked
            before = ray.get([a.cpu.remote() for a in actors])
            if kind == "relay":
                times = _relay_round(relay, x, table, steps)
            else:
                times = await _links_round(links, x, table, steps)
            after = ray.get([a.cpu.remote() for a in actors])
            found[kind] += times
            cpu[kind].append(max((b - a) / steps for a, b in zip(before, after, strict=True)))
    idle_before = ray.get([a.cpu.remote() for a in linked])
    time.sleep(5)
    idle_after = ray.get([a.cpu.remote() for a in linked])
    quotas = ray.get([a.quota.remote() for a in relay])

    def figures(kind: str) -> dict:
        p50 = statistics.median(found[kind])
        return {
            "round_trip_p50_ms": round(1000 * p50, 3),
            "round_trip_p90_ms": round(1000 * _p(found[kind], 0.9), 3),
            "per_hop_p50_ms": round(1000 * p50 / 4, 3),
            "busiest_stage_cpu_ms_per_step": round(1000 * statistics.median(cpu[kind]), 3),
        }

    return {
        "nodes": [n["NodeManagerAddress"] for n in nodes],
        "quotas": quotas,
        "steps_per_round": steps,
        "rounds": rounds,
        "relay": figures("relay"),
        "links": figures("links"),
        "links_over_relay_round_trip": round(statistics.median(found["links"]) / statistics.median(found["relay"]), 3),
        "links_idle_cpu_per_s": [round((b - a) / 5, 4) for a, b in zip(idle_before, idle_after, strict=True)],
    }


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    print(json.dumps(asyncio.run(main(count, 6)), indent=2))
