"""A decode step's hop through three no-op stage actors, one per node: the driver relay (what `serve`'s engine
did until session 24), the actors handing on to each other (``chained``, what it does since), a Ray Compiled
Graph, and what a compiled actor spends while it waits for input.

Run on the cluster as a job (its driver is on the head, as `serve`'s ingress is):
  raycluster submit -i INVENTORY --working-dir benchmarks -- python cgraph_hops.py 200
Prints one JSON document: each node's CPU quota, the relay's and the compiled graph's round trip (p50, per hop),
each actor's CPU per second while idle before and after compiling, and the relay's CPU per call on each actor.
"""

import itertools
import json
import os
import statistics
import sys
import time

import ray
import torch
from ray.dag import InputNode
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@ray.remote(num_cpus=0)
class Hop:
    def __init__(self) -> None:
        self.following = None

    def hop(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def link(self, following) -> None:
        self.following = following

    def chain(self, x: torch.Tensor):
        """As a linked serve stage does: hand the input to the next actor, return that call's ref."""
        return x if self.following is None else self.following.chain.remote(x)

    def cpu(self) -> float:
        t = os.times()  # this process, every thread
        return t.user + t.system

    def quota(self) -> float | None:
        from raycluster_cli.bench.cgroup import container_cpu_quota  # the node image has the package

        return container_cpu_quota()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), ignore_reinit_error=True)
    nodes = [x["NodeID"] for x in sorted(ray.nodes(), key=lambda x: x["NodeManagerAddress"]) if x["Alive"]]
    nodes = (nodes * 3)[:3]  # one node: three actors on it
    actors = [Hop.options(scheduling_strategy=NodeAffinitySchedulingStrategy(x, soft=False)).remote() for x in nodes]
    x = torch.zeros(4, 1, 512)  # a decode step of 4 rows at width 512 (serve_targets' model)

    def cpu() -> list[float]:
        return ray.get([a.cpu.remote() for a in actors])

    def timed(fn, count: int) -> list[float]:
        for _ in range(10):
            fn()
        out = []
        for _ in range(count):
            began = time.perf_counter()
            fn()
            out.append(time.perf_counter() - began)
        return out

    def relay() -> torch.Tensor:
        ref = x
        for a in actors:
            ref = a.hop.remote(ref)
        return ray.get(ref)

    def idle() -> list[float]:
        before = cpu()
        time.sleep(3)
        return [(b - a) / 3 for a, b in zip(before, cpu(), strict=True)]

    doc: dict = {"quotas": ray.get([a.quota.remote() for a in actors]), "payload_bytes": x.numel() * 4}
    before = cpu()
    r = timed(relay, n)
    doc["relay"] = {
        "round_trip_ms_p50": 1000 * statistics.median(r),
        "per_hop_ms": 1000 * statistics.median(r) / 3,
        "actor_cpu_per_call_ms": [1000 * (b - a) / (n + 10) for a, b in zip(before, cpu(), strict=True)],
    }
    doc["plain_idle_cpu_per_s"] = idle()
    ray.get([a.link.remote(b) for a, b in itertools.pairwise(actors)])

    def chained() -> torch.Tensor:  # serve's engine since session 24: one call, the stages hand on
        value = ray.get(actors[0].chain.remote(x))
        while isinstance(value, ray.ObjectRef):
            value = ray.get(value)
        return value

    before = cpu()
    c = timed(chained, n)
    doc["chained"] = {
        "round_trip_ms_p50": 1000 * statistics.median(c),
        "per_hop_ms": 1000 * statistics.median(c) / 3,
        "actor_cpu_per_call_ms": [1000 * (b - a) / (n + 10) for a, b in zip(before, cpu(), strict=True)],
    }
    with InputNode() as inp:
        dag = actors[2].hop.bind(actors[1].hop.bind(actors[0].hop.bind(inp)))
    began = time.perf_counter()
    try:
        compiled = dag.experimental_compile()
        doc["compile_s"] = time.perf_counter() - began
        doc["compiled_idle_cpu_per_s"] = idle()
        g = timed(lambda: ray.get(compiled.execute(x), timeout=30), max(20, n // 4))
        doc["compiled"] = {
            "round_trip_ms_p50": 1000 * statistics.median(g),
            "per_hop_ms": 1000 * statistics.median(g) / 3,
            "round_trip_ms_p90": 1000 * sorted(g)[int(0.9 * len(g))],
        }
        compiled.teardown()
    except Exception as exc:  # a compile or a read that fails is the finding, reported
        doc["compiled_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
