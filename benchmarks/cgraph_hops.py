"""A decode step's hop through three no-op stage actors, one per node: the driver relay (what `serve`'s engine
does), two stage-to-stage hand-offs (``chained``: each actor calls the next and returns that call's ObjectRef,
the driver follows the refs; ``awaited``: async actors, each awaiting the next and answering its caller), a Ray
Compiled Graph, and what a compiled actor spends while it waits for input.

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
        """Hand the input to the next actor and return that call's ref (a nested ObjectRef)."""
        return x if self.following is None else self.following.chain.remote(x)

    def cpu(self) -> float:
        t = os.times()  # this process, every thread
        return t.user + t.system

    def quota(self) -> float | None:
        from raycluster_cli.node.cgroup import container_cpu_quota  # the node image has the package

        return container_cpu_quota()


@ray.remote(num_cpus=0)
class AwaitHop:
    """An async actor: awaits the next actor's call and answers its own caller with the result."""

    def __init__(self) -> None:
        self.following = None

    def link(self, following) -> None:
        self.following = following

    async def chain(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.following is None else await self.following.chain.remote(x)

    def cpu(self) -> float:
        t = os.times()
        return t.user + t.system


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), ignore_reinit_error=True)
    nodes = [x["NodeID"] for x in sorted(ray.nodes(), key=lambda x: x["NodeManagerAddress"]) if x["Alive"]]
    nodes = (nodes * 3)[:3]  # one node: three actors on it
    actors = [Hop.options(scheduling_strategy=NodeAffinitySchedulingStrategy(x, soft=False)).remote() for x in nodes]
    waiters = [
        AwaitHop.options(scheduling_strategy=NodeAffinitySchedulingStrategy(x, soft=False)).remote() for x in nodes
    ]
    x = torch.zeros(4, 1, 512)  # a decode step of 4 rows at width 512 (serve_targets' model)

    def cpu() -> list[float]:
        return ray.get([a.cpu.remote() for a in actors + waiters])

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
        return [(b - a) / 3 for a, b in zip(before[:3], cpu()[:3], strict=True)]  # the Hop actors

    def chained() -> torch.Tensor:
        value = ray.get(actors[0].chain.remote(x))
        while isinstance(value, ray.ObjectRef):
            value = ray.get(value)
        return value

    def awaited() -> torch.Tensor:
        return ray.get(waiters[0].chain.remote(x))

    doc: dict = {"quotas": ray.get([a.quota.remote() for a in actors]), "payload_bytes": x.numel() * 4}
    ray.get([a.link.remote(b) for a, b in itertools.pairwise(actors)])
    ray.get([a.link.remote(b) for a, b in itertools.pairwise(waiters)])
    # relay and chained alternate in 4 blocks each (a shared machine's load falls on both); CPU per call of
    # every actor and of this driver (the engine's place), whose share the hand-off moves to the actors
    modes = {"relay": relay, "chained": chained, "awaited": awaited}
    found: dict = {m: {"times": [], "actors": [0.0] * 6, "driver": 0.0, "calls": 0} for m in modes}
    for _ in range(4):
        for mode, fn in modes.items():
            before, driver = cpu(), time.process_time()
            found[mode]["times"] += timed(fn, n // 4)
            found[mode]["driver"] += time.process_time() - driver
            found[mode]["actors"] = [t + b - a for t, a, b in zip(found[mode]["actors"], before, cpu(), strict=True)]
            found[mode]["calls"] += n // 4 + 10
    for mode, f in found.items():
        doc[mode] = {
            "round_trip_ms_p50": 1000 * statistics.median(f["times"]),
            "per_hop_ms": 1000 * statistics.median(f["times"]) / 3,
            "actor_cpu_per_call_ms": [1000 * t / f["calls"] for t in f["actors"][3:] if mode == "awaited"]
            or [1000 * t / f["calls"] for t in f["actors"][:3]],
            "driver_cpu_per_call_ms": 1000 * f["driver"] / f["calls"],
        }
    doc["plain_idle_cpu_per_s"] = idle()
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
