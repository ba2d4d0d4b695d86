"""The pipeline's stages as Ray actors: one ``BatchedStage`` per actor, optionally pinned to a node.

A step goes ``stage0.forward -> stage1.forward -> ...``, each call taking the previous call's
ObjectRef, as the bench's driver hops do: activations of a step are small and travel through Ray's
object store; Ray runs an actor's calls in order, so steps in flight never overtake each other.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycluster_cli.models.batched import BatchedStage
from raycluster_cli.models.config import ModelConfig
from raycluster_cli.node.cgroup import container_cpu_quota, container_cpu_usage, node_capacity
from raycluster_cli.node.gcpause import FullCollections, freeze_heap
from raycluster_cli.node.links import MIN_CAPACITY, StageLoop
from raycluster_cli.node.nodes import WORKER_ENV, gpu_shares, node_cpu_count, node_ip, pick_device
from raycluster_cli.node.reach import REACH_TIMEOUT_S, unreachable
from raycluster_cli.node.rendezvous import Joining
from raycluster_cli.placement.partition import Ranges, even_partition, manual_partition
from raycluster_cli.serve.anatomy import TIMELINE_STEPS
from raycluster_cli.serve.metrics import RayRecorder, StageMeter


def split_units(layers: int, stages: int, split: Sequence[int] | str | None = None) -> Ranges:
    """Unit ranges of the stages: ``split`` gives each stage's block count ("2,1" or [2, 1]); without
    it the blocks are split evenly.  (The balanced split from measured costs plugs in here later.)"""
    if split is None or split == "":
        return even_partition(layers, stages)
    ranges = manual_partition(split, layers)
    if len(ranges) != stages:
        raise ValueError(f"split {split!r} has {len(ranges)} stages, {stages} were asked for")
    return ranges


class _StageActor:
    """Holds units [start, end) and ``slots`` KV cache slots (grown by blocks within ``kv_tokens`` positions in
    all) on one node; counts the steps it ran."""

    def __init__(
        self,
        cfg: dict[str, Any],
        start: int,
        end: int,
        slots: int,
        num_threads: int | None,
        metric_tags: dict[str, str] | None = None,
        kv_tokens: int = 0,
    ) -> None:
        self.node_id: str = ray.get_runtime_context().get_node_id()
        torch.set_num_threads(num_threads or node_cpu_count(self.node_id))
        began = time.perf_counter()
        self.stage = BatchedStage(
            ModelConfig.from_dict(cfg), start, end, slots, device=pick_device(),
            room_bytes=lambda: node_capacity("", "").usable, kv_tokens=kv_tokens,
        )  # fmt: skip
        self.load_s = time.perf_counter() - began
        self.units = (start, end)
        self.steps = 0
        self.busy_s = 0.0
        self.forward_cpu_s = 0.0  # CPU seconds inside forward: cpu_s less this is Ray's own work per call
        # (step number, wall start, wall end) of the last steps: where a step's time goes (serve.anatomy)
        self.recent: deque[tuple[int, float, float]] = deque(maxlen=TIMELINE_STEPS)
        self._recent_lock = threading.Lock()  # the links thread steps while other threads read the timeline, totals
        self.links: StageLoop | None = None
        self.joining: Joining | None = None  # the ring in formation (node.rendezvous), then its proven group
        self.ring: tuple[Any, int, int, int] | None = None
        freeze_heap()  # the weights' modules and Ray's objects: never walked by a full collection again
        self.collections = FullCollections()
        # the service's stage metrics (model, pipeline, stage; serve.metrics), none for a stage of no service
        if metric_tags:
            StageMeter(RayRecorder(), {**metric_tags, "node_ip": node_ip(self.node_id)}, self._totals).start()

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        began, wall, cpu = time.perf_counter(), time.time(), time.process_time()
        out = self.stage.forward(x, table)
        spent = time.perf_counter() - began
        self.forward_cpu_s += time.process_time() - cpu
        with self._recent_lock:
            self.recent.append((self.steps, wall, wall + spent))
            self.steps += 1
            self.busy_s += spent
        return out

    def release(self, ended: list[tuple[int, int]]) -> None:
        """Sequences that ended or were preempted give their slots' K/V back (``BatchedStage.release``)."""
        self.stage.release(ended)

    def _totals(self) -> tuple[int, float]:
        """Steps and busy seconds read together (the metrics thread's, while the links thread steps)."""
        with self._recent_lock:
            return self.steps, self.busy_s

    def timeline(self) -> list[tuple[int, float, float]]:
        """The last steps' (number, wall start, wall end): the k-th step here is the engine's k-th (it
        sends every step through every stage, in order: Ray runs one caller's calls to an actor in order, and
        each direct link is one ordered connection)."""
        with self._recent_lock:
            return list(self.recent)

    @ray.method(concurrency_group="links")
    def offer_links(self, rank: int, size: int) -> dict[str, bytes]:
        """Start joining the pipeline's ring of direct links as ``rank`` of ``size`` (``node.rendezvous``; rank 0
        is the engine), its links bound to this node's Ray address: this rank's address records, for the engine to
        hand to every rank."""
        self.joining = Joining(rank, size, node_ip(self.node_id))
        return self.joining.offer()

    @ray.method(concurrency_group="links")
    def join_links(self, records: dict[str, bytes], secret: bytes, capacity: int = MIN_CAPACITY) -> str:
        """Connect to every rank at ``records`` and prove the ring's ``secret`` on every link (``capacity``: the
        ring's message size, ``node.links.link_capacity``); no step is read until ``run_links``.  The address
        this stage's links are bound to."""
        joining, self.joining = self.joining, None
        if joining is None:
            raise RuntimeError("join_links before offer_links")
        self.ring = (joining.join(records, secret), joining.rank, joining.size, capacity)
        return node_ip(self.node_id)

    @ray.method(concurrency_group="links")
    def run_links(self) -> None:
        """Serve steps from the ring on a thread (every rank proved its links)."""
        if self.ring is None:
            raise RuntimeError("run_links before join_links")
        (group, rank, size, capacity), self.ring = self.ring, None
        self.links = StageLoop(group, rank, size, self.forward, capacity)
        self.links.start()

    @ray.method(concurrency_group="links")
    def links_ended(self) -> str:
        """Block until this stage's links loop ends (a neighbour died, a forward failed); why it ended.  A stage
        without links (Ray's calls relay its steps) never answers: the engine holds the call open, and the
        process's end fails it at once (``Engine(watch=True)``)."""
        if self.links is None:
            threading.Event().wait()  # never set: held until this process ends
            return "this stage has no links"
        return self.links.wait()

    @ray.method(concurrency_group="health")
    def reach(self, targets: list[tuple[str, str, int]], timeout_s: float = REACH_TIMEOUT_S) -> list[str]:
        """The names of ``targets`` (name, ip, port: the other stages' nodes' Ray object manager) this node cannot
        open a connection to (``node.reach``): asked, on the ping's thread, when a pipeline's steps are overdue
        while every stage answers its ping."""
        return unreachable(targets, timeout_s)

    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        """This process's pid, answered on a thread of its own: alive even while steps queue on the default
        thread (the relay) or run on the links thread.  No answer within seconds while the pipeline's steps are
        overdue: its host is frozen or cut off (``serve.pool``'s liveness look)."""
        return os.getpid()

    def counters(self) -> dict[str, Any]:
        """What a benchmark diffs before/after a run: steps, seconds inside forward, this process's CPU
        seconds (Ray's per-call work included) and the pid (a new actor starts again from zero)."""
        return {
            "pid": os.getpid(),
            "steps": self.steps,
            "busy_s": self.busy_s,
            "cpu_s": time.process_time(),
            "forward_cpu_s": self.forward_cpu_s,
            "gc_s": self.collections.total_s,  # seconds in full collections: a step that ran into one waited
            # the stage's container: every process on its node (Ray's, the ingress and proxy on the head) against
            # its quota, so a run shows which node's CPU was used up
            "node_cpu_s": container_cpu_usage(),
            "node_cpu_quota": container_cpu_quota(),
        }

    def visible_gpus(self) -> str:
        """The GPUs Ray made visible to this stage ("" on a CPU node)."""
        return os.environ.get("CUDA_VISIBLE_DEVICES", "")

    def info(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "node_ip": node_ip(self.node_id),
            "pid": os.getpid(),
            "units": list(self.units),
            "device": str(self.stage.device),
            # the decode steps' products as measured cheapest on this node (models.matmuls): row count -> form
            "matmuls": {
                "blocks": self.stage.block_mm.describe(),
                "head": self.stage.head_mm.describe(),
                "packed_mb": round((self.stage.block_mm.packed_bytes + self.stage.head_mm.packed_bytes) / 2**20, 1),
            },
            "load_s": self.load_s,
            "steps": self.steps,
            "busy_s": self.busy_s,
        }


# forward, counters and timeline run on the actor's one default thread (in order, as the relay needs); forming
# the ring (one call at a time) and waiting for its end each get a thread of their own, and so does the liveness ping
StageActor = ray.remote(num_cpus=0, concurrency_groups={"links": 2, "health": 1})(_StageActor)  # type: ignore[call-overload]
STAGE_NAMESPACE = "raycluster-serve"


def start_stages(
    cfg: ModelConfig,
    ranges: Ranges,
    slots: int,
    *,
    node_ids: Sequence[str] | None = None,
    num_threads: int | None = None,
    names: Sequence[str] | None = None,
    timeout_s: float | None = None,
    gpus: Mapping[str, float] | None = None,
    metric_tags: Sequence[dict[str, str]] | None = None,
    kv_tokens: int = 0,
) -> tuple[list[Any], list[dict[str, Any]]]:
    """One StageActor per range (hard-pinned to ``node_ids[i]`` when given and not ""); returns their
    handles once their units are loaded, and what each reported then (``info``: its device, its products' plan).  On a node with GPUs (``gpus``: each node's count) a stage asks Ray
    for its share of them (``node.stage_worker.gpu_shares``), so Ray makes its GPU visible and the stage runs
    on ``cuda`` there, each stage of a node on its own GPU while there are enough.  ``metric_tags``: each stage's
    tags for the service's stage metrics (``serve.metrics``), none recorded without them.  ``kv_tokens``: each
    stage's KV budget in positions (0: ``slots`` at full context).  ``names`` names the actors (in ``STAGE_NAMESPACE``), so an
    operator or a test can find a pipeline's stages.  ``timeout_s``: the stages not up by then (a node
    that died while they loaded) fail the start (``GetTimeoutError``) instead of holding the caller."""
    if node_ids is not None and len(node_ids) != len(ranges):
        raise ValueError(f"{len(node_ids)} nodes for {len(ranges)} stages")
    actors: list[Any] = []
    shares = gpu_shares(node_ids, gpus or {}) if node_ids is not None else [0.0] * len(ranges)
    for index, (start, end) in enumerate(ranges):
        options: dict[str, Any] = {"runtime_env": {"env_vars": dict(WORKER_ENV)}}
        if node_ids is not None and node_ids[index]:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_ids[index], soft=False)
        if shares[index]:
            options["num_gpus"] = shares[index]
        if names is not None:
            options |= {"name": names[index], "namespace": STAGE_NAMESPACE}
        tags = metric_tags[index] if metric_tags is not None else None
        actors.append(
            StageActor.options(**options).remote(cfg.to_dict(), start, end, slots, num_threads, tags, kv_tokens)
        )
    try:
        infos: list[dict[str, Any]] = ray.get([a.info.remote() for a in actors], timeout=timeout_s)
    except Exception:
        for actor in actors:  # none of a half-started pipeline is left holding memory
            ray.kill(actor)
        raise
    return actors, infos
