"""The pool's backend on Ray: which nodes are alive, what each one costs per unit, and pipelines on them.

A node's speed is measured with the bench's own calibration (``node.stage_worker``: a ``StageWorker``
pinned to the node times embedding, block and head; ``balance.capacity_costs`` weighs the CPU time
against the node's quota, ``unit_cost_row`` turns that into a cost per unit), all nodes at once.  The launcher measures every alive node before the
first placement and hands the costs to the ingress (``ServeSettings.speeds``), which measures only
nodes it has not seen (one that joined, or came back) when it re-plans.  While it serves, each pipeline's stages
are read between looks (``rebalance``): their seconds per step under load correct the calibration, and a split
that makes the slowest stage markedly faster replaces the pipeline (``placement.resplit``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycluster_cli.models.config import ModelConfig
from raycluster_cli.node.links import DirectLinks, link_capacity
from raycluster_cli.node.nodes import measure_rooms, node_gpus
from raycluster_cli.node.reach import REACH_TIMEOUT_S, connected, cut_pairs, describe, unreachable
from raycluster_cli.node.rendezvous import form_ring
from raycluster_cli.node.stage_worker import calibrate_workers, start_workers, stop_workers, unit_cost_row
from raycluster_cli.placement.balance import capacity_costs, capacity_time
from raycluster_cli.placement.pipelines import NodeSpeed, PipelinePlan, replan, resplit, snake_groups, split_over
from raycluster_cli.serve.engine import Engine
from raycluster_cli.serve.pool import Pipeline
from raycluster_cli.serve.scheduler import Limits
from raycluster_cli.serve.stages import start_stages

BUILD_TIMEOUT_S = 300.0  # a pipeline that does not load and generate within this is given up
MEASURE_TIMEOUT_S = 180.0  # a calibration of new nodes (one may die while it runs) that takes longer is given up
NODES_TIMEOUT_S = 30.0  # the GCS's list of nodes
# A node the GCS still lists may have died seconds ago (its health checks take from seconds to a minute to
# fail): before a pipeline is rebuilt on its own nodes, each must run a trivial task within this.
NODE_ANSWER_TIMEOUT_S = 15.0
COUNTERS_TIMEOUT_S = 10.0  # the stages' counters (they answer between steps)
# A window of serving is judged only when every stage ran this many steps in it and the busiest stage was busy
# this share of it: an idle or nearly idle pipeline's timings are noise, and its balance does not matter.
REBALANCE_MIN_STEPS = 40
REBALANCE_MIN_BUSY = 0.3
KV_NAMESPACE = b"raycluster"  # our keys in the GCS's key-value store
KV_TIMEOUT_S = 10.0  # a read or write of that store


class GcsMarks:
    """The text service's drained marks kept in the cluster's GCS key-value store (serve/draining.py): they outlive
    the ingress's process (Serve starts another when it dies) and a redeploy (a node stays out until `undrain`), but
    not the GCS (a head started again without Redis-backed fault tolerance comes back empty: every node serves)."""

    key = b"serve-drained"

    @staticmethod
    def _gcs() -> Any:
        worker: Any = ray._private.worker.global_worker  # its GCS client's calls take a deadline (internal_kv's do not)
        return worker.gcs_client

    async def save(self, drained: dict[str, float]) -> None:
        value = json.dumps(drained, sort_keys=True).encode()
        await self._gcs().async_internal_kv_put(self.key, value, True, KV_NAMESPACE, timeout=KV_TIMEOUT_S)

    async def load(self) -> dict[str, float]:
        value = await self._gcs().async_internal_kv_get(self.key, KV_NAMESPACE, timeout=KV_TIMEOUT_S)
        data = json.loads(value) if value else {}
        return {str(n): float(t) for n, t in data.items()} if isinstance(data, dict) else {}


@dataclass(frozen=True)
class Calibration:
    """The serving step the nodes are timed on: a few rows decoding after a short prompt."""

    batch: int = 4
    prompt_len: int = 32
    decode_steps: int = 8
    repeats: int = 3
    min_sample_s: float = 0.1
    prefill_chunk: int = 64


def alive_nodes() -> dict[str, str]:
    """Node id -> IP of every alive Ray node that has CPUs for a stage."""
    return {
        str(n["NodeID"]): str(n.get("NodeManagerAddress", ""))
        for n in ray.nodes()
        if n.get("Alive") and float(n.get("Resources", {}).get("CPU", 0.0)) > 0
    }


@ray.remote(num_cpus=0)
def _node_id() -> str:
    return str(ray.get_runtime_context().get_node_id())


def object_ports() -> dict[str, tuple[str, int]]:
    """Node id -> (IP, Ray object manager port) of every alive node: what ``node.reach`` tries between nodes."""
    return {
        str(n["NodeID"]): (str(n.get("NodeManagerAddress", "")), int(n.get("ObjectManagerPort") or 0))
        for n in ray.nodes()
        if n.get("Alive") and n.get("ObjectManagerPort")
    }


def _targets(node_ids: Sequence[str], ports: dict[str, tuple[str, int]]) -> list[tuple[str, str, int]]:
    return [(n, *ports[n]) for n in dict.fromkeys(node_ids) if n in ports]


@ray.remote(num_cpus=0)
def _unreachable(targets: list[tuple[str, str, int]]) -> list[str]:
    return unreachable(targets)


def cuts_among(node_ids: Sequence[str], timeout_s: float = NODE_ANSWER_TIMEOUT_S) -> set[frozenset[str]]:
    """The pairs of ``node_ids`` that cannot reach each other (``node.reach``): a task pinned to each node tries the
    others' object manager ports.  A node whose task did not answer within ``timeout_s`` reports nothing (whether it
    lives is ``answering``'s question)."""
    nodes = list(dict.fromkeys(n for n in node_ids if n))
    if len(nodes) < 2:
        return set()
    targets = _targets(nodes, object_ports())
    reports = on_each(nodes, _unreachable, lambda node: ([t for t in targets if t[0] != node],), timeout_s)
    return cut_pairs(reports)


async def cut_between(pipeline: Pipeline) -> str | None:
    """Every stage answered its ping, yet the pipeline's steps are overdue: can the stages' nodes reach each other
    (each stage tries the others' nodes, on its ping's thread)?  Which ones cannot, for a person; None when all can
    (or the stages are not pinned to nodes)."""
    nodes = [n for n in pipeline.plan.node_ids if n]
    if len(set(nodes)) < 2 or len(nodes) != len(pipeline.stages):
        return None
    ports = await asyncio.wait_for(asyncio.to_thread(object_ports), NODES_TIMEOUT_S)
    targets = _targets(nodes, ports)
    asked = [a.reach.remote([t for t in targets if t[0] != n]) for a, n in zip(pipeline.stages, nodes, strict=True)]
    answers = await asyncio.wait_for(asyncio.gather(*asked), REACH_TIMEOUT_S + 5)
    cuts = cut_pairs(dict(zip(nodes, answers, strict=True)))
    if not cuts:
        return None
    names = dict(zip(pipeline.plan.node_ids, pipeline.plan.ips, strict=True))
    return f"its stages' nodes cannot reach each other: {describe(cuts, names)}"


def on_each(
    nodes: Sequence[str], task: Any, args: Callable[[str], tuple[Any, ...]], timeout_s: float
) -> dict[str, Any]:
    """``task`` run pinned to each of ``nodes`` (``args(node)`` its arguments), all at once: node -> its result, for
    the nodes whose task answered within ``timeout_s`` (the late ones cancelled, a failed one left out)."""
    refs = {
        node: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(
            *args(node)
        )
        for node in nodes
    }
    if not refs:
        return {}
    ready, late = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    for ref in late:
        with contextlib.suppress(Exception):
            ray.cancel(ref, force=True)
    results: dict[str, Any] = {}
    for node, ref in refs.items():
        with contextlib.suppress(Exception):
            if ref in ready:
                results[node] = ray.get(ref, timeout=1)
    return results


def answering(node_ids: Sequence[str], timeout_s: float = NODE_ANSWER_TIMEOUT_S) -> set[str]:
    """The nodes among ``node_ids`` that ran a trivial task pinned to them within ``timeout_s``."""
    ran = on_each(node_ids, _node_id, lambda node: (), timeout_s)
    return {node for node, answer in ran.items() if answer == node}


def measure(cfg: ModelConfig, nodes: dict[str, str], calibration: Calibration) -> list[NodeSpeed]:
    """Each node's cost per unit from the bench's calibration, every node timed at once, as capacity time
    (``balance.capacity_costs``: CPU seconds against the node's quota, which the wall clock of nodes timed
    together on shared cores does not show)."""
    ids = list(nodes)
    if not ids:
        return []
    workers = start_workers(cfg, ids, allow_shared_nodes=True, gpu_nodes=node_gpus())  # timed where stages run
    try:
        c = calibration
        found = calibrate_workers(
            workers, c.batch, c.prompt_len, c.decode_steps, c.repeats, c.min_sample_s, c.prefill_chunk
        )
    finally:
        stop_workers(workers)
    return [
        NodeSpeed(node_id, nodes[node_id], tuple(unit_cost_row(capacity_costs(cal), cfg.layers)))
        for node_id, cal in zip(ids, found, strict=True)
    ]


class RayFleet:
    """Builds pipelines as stage actors on their nodes and re-plans them from the alive nodes."""

    def __init__(
        self,
        cfg: ModelConfig,
        tokenizer: Any,
        limits: Limits,
        eos: frozenset[int],
        *,
        stages: int,
        speeds: Sequence[NodeSpeed] = (),
        calibration: Calibration | None = None,
        num_threads: int | None = None,
        max_in_flight: int | None = None,
        unit_bytes: Sequence[int] | None = None,
        stage_fixed_bytes: int = 0,
        links: str = "direct",
        model: str = "",
    ) -> None:
        self.cfg, self.tokenizer, self.limits, self.eos = cfg, tokenizer, limits, eos
        self.model = model  # the served model's id: its stages' metrics are tagged with it ("": no metrics)
        self.links = links  # "direct": a ring of links between the stages (node.links); "ray": Ray's calls
        self.unit_bytes = list(unit_bytes) if unit_bytes else None  # each unit's bytes (weights + KV slots)
        self.stage_fixed_bytes = stage_fixed_bytes  # what every stage needs besides its units (a step's tensors)
        self._counted: dict[int, tuple[float, list[dict[str, Any]]]] = {}  # pipeline -> (when, its stages' counters)
        # the splits a re-split left, per set of nodes in stage order: never re-split back into one of them
        self._left: dict[tuple[str, ...], set[tuple[tuple[int, int], ...]]] = {}
        self.stages = stages
        self.speeds = {s.node_id: s for s in speeds if s.node_id}
        self.calibration = calibration or Calibration(prefill_chunk=limits.prefill_chunk)
        self.num_threads = num_threads
        self.max_in_flight = max_in_flight
        self.drained: set[str] = set()  # node ids or IPs the operator drained: no stage goes there

    async def build(self, plan: PipelinePlan, index: int) -> tuple[Engine, list[Any]]:
        names = [f"raycluster-stage-{index}-{s}" for s in range(len(plan.ranges))]
        limits = self.limits.for_steps(self.max_in_flight or len(plan.ranges))  # slots for every step in flight
        gpus = await asyncio.wait_for(asyncio.to_thread(node_gpus), NODES_TIMEOUT_S)  # stages on GPU nodes ask a share
        actors, infos = await asyncio.wait_for(
            asyncio.to_thread(
                start_stages,
                self.cfg,
                list(plan.ranges),
                limits.slots,
                node_ids=plan.node_ids,
                num_threads=self.num_threads,
                names=names,
                timeout_s=BUILD_TIMEOUT_S,
                gpus=gpus,
                kv_tokens=limits.kv_budget,
                metric_tags=[
                    {"model": self.model, "pipeline": str(index), "stage": str(s)} for s in range(len(plan.ranges))
                ]
                if self.model
                else None,
            ),
            BUILD_TIMEOUT_S + 10,
        )
        links, why = await self._connect(actors, limits) if self.links == "direct" else (None, None)
        engine = Engine(
            actors, self.tokenizer, limits, self.eos, self.max_in_flight, links=links, watch=True, vocab=self.cfg.vocab
        )
        engine.links_note = why
        engine.stage_infos = infos
        engine.start()
        try:
            await engine.probe()
        except BaseException:
            await engine.close()
            _kill(actors)
            raise
        return engine, actors

    async def _connect(self, actors: Sequence[Any], limits: Limits) -> tuple[DirectLinks | None, str | None]:
        """The ring of direct links over ``actors`` (the engine is rank 0, on its node's Ray address), or None
        when it does not form within ``node.links.CONNECT_TIMEOUT_S`` (a firewall between nodes that lets only Ray's ports
        through): the pipeline then keeps Ray's calls, and the note (status shows it) says why."""
        ip = ray.util.get_node_ip_address()
        size = len(actors) + 1
        # every rank's receive buffer holds a decode step of the most rows a step carries (hidden states or logits)
        capacity = link_capacity(min(limits.slots, limits.step_tokens), self.cfg.d_model, self.cfg.vocab)
        try:
            group = await form_ring(actors, ip, capacity)
        except Exception as exc:
            return None, f"direct links did not form ({type(exc).__name__}: {exc}): steps go through Ray's calls"
        links = DirectLinks(group, size, capacity)
        links.start(actors)
        return links, None

    async def stop(self, pipeline: Pipeline) -> None:
        _kill(pipeline.stages)

    def exclude(self, nodes: set[str]) -> None:
        self.drained = set(nodes)

    async def _usable(self) -> dict[str, str]:
        """The alive nodes less the drained ones (by id or by IP)."""
        return {n: ip for n, ip in (await _alive()).items() if n not in self.drained and ip not in self.drained}

    async def unanswered(self, pipeline: Pipeline, timeout_s: float) -> str | None:
        """Each stage pinged at once (``ping`` answers on a thread of its own, beside the steps): the first that
        did not answer within ``timeout_s`` or failed, with its node's address; None when all answered."""
        pings = [asyncio.ensure_future(a.ping.remote()) for a in pipeline.stages]
        _, late = await asyncio.wait(pings, timeout=timeout_s)
        for ping in late:  # a frozen node's ping would wait until Ray gives the node up: not kept
            ping.cancel()
        for index, ping in enumerate(pings):
            where = f"stage {index} on {pipeline.plan.ips[index] or 'its node'}"
            if ping in late:
                return f"{where} did not answer within {timeout_s:.0f} s"
            if (exc := ping.exception()) is not None:
                return f"{where} failed to answer: {type(exc).__name__}: {exc}"
        return await cut_between(pipeline)

    async def _cuts(self, node_ids: Sequence[str]) -> set[frozenset[str]]:
        return await asyncio.wait_for(asyncio.to_thread(cuts_among, node_ids), NODE_ANSWER_TIMEOUT_S + 10)

    async def _speeds(self, nodes: dict[str, str]) -> dict[str, NodeSpeed]:
        unknown = {n: ip for n, ip in nodes.items() if n not in self.speeds}
        if unknown:
            timed = asyncio.to_thread(measure, self.cfg, unknown, self.calibration)
            speeds = await asyncio.wait_for(timed, MEASURE_TIMEOUT_S)
            if self.unit_bytes:  # a node measured now gets its room too, as the launcher's nodes had
                found = asyncio.to_thread(measure_rooms, list(unknown), MEASURE_TIMEOUT_S)
                rooms = {c.node_id: c.usable for c in await asyncio.wait_for(found, MEASURE_TIMEOUT_S + 10)}
                speeds = [replace(s, capacity=max(0, rooms[s.node_id] - self.stage_fixed_bytes)) for s in speeds]
            for speed in speeds:
                self.speeds[speed.node_id] = speed
        return {n: self.speeds[n] for n in nodes}

    async def replacement(self, dead: Pipeline, others: Sequence[Pipeline]) -> PipelinePlan | None:
        """The same plan when every node of it lives and answers (only an actor died); else its survivors
        re-split, with free nodes added up to the stage count, within each node's memory where it is known
        (``DoesNotFit`` when they cannot hold the model: no pipeline is built to be killed for memory)."""
        alive = await self._usable()
        mine = dead.plan.node_ids
        pinned = [n for n in mine if n and n in alive]
        if pinned:  # a node that died moments ago is still listed: only the ones that answer count
            heard = await asyncio.wait_for(asyncio.to_thread(answering, pinned), NODE_ANSWER_TIMEOUT_S + 10)
            alive = {n: ip for n, ip in alive.items() if n in heard or n not in mine}
        used = {n for p in others for n in p.plan.node_ids}
        unused = {n: ip for n, ip in alive.items() if n not in used and n not in mine}
        # one look at who reaches whom, over the survivors and the free nodes they could take
        cuts = await self._cuts([*(n for n in mine if n in alive), *unused])
        if all(not n or n in alive for n in mine) and not any(pair <= set(mine) for pair in cuts):
            return dead.plan
        survivors = await self._speeds({n: alive[n] for n in mine if n in alive})
        free = await self._speeds(unused)
        if cuts:  # two of the nodes cannot reach each other: only a set of nodes that all can is planned over
            order = [s.node_id for s in sorted(survivors.values(), key=lambda s: sum(s.unit_costs))]
            order += [s.node_id for s in sorted(free.values(), key=lambda s: sum(s.unit_costs))]
            keep = set(connected(order, cuts))
            survivors = {n: s for n, s in survivors.items() if n in keep}
            free = {n: s for n, s in free.items() if n in keep}
        return replan(list(survivors.values()), list(free.values()), self.stages, self.cfg.layers, self.unit_bytes)

    async def rebalance(self, pipeline: Pipeline) -> PipelinePlan | None:
        """The pipeline re-split from its stages' seconds per step since the last look, when the window was
        loaded enough to judge and the new split gains enough (``placement.resplit``); the corrected costs are
        kept for later re-plans.  None: keep it (also on the first look, which only starts the window)."""
        plan = pipeline.plan
        if plan.stages < 2 or not all(plan.node_ids) or any(n not in self.speeds for n in plan.node_ids):
            return None
        asked = asyncio.gather(*(a.counters.remote() for a in pipeline.stages))
        counters = list(await asyncio.wait_for(asked, COUNTERS_TIMEOUT_S))
        now = time.monotonic()
        before = self._counted.get(pipeline.index)
        self._counted[pipeline.index] = (now, counters)
        if before is None or any(a["pid"] != b["pid"] for a, b in zip(counters, before[1], strict=True)):
            return None
        window = now - before[0]
        steps = [a["steps"] - b["steps"] for a, b in zip(counters, before[1], strict=True)]
        busy = [capacity_s(a, b) for a, b in zip(counters, before[1], strict=True)]
        if min(steps) < REBALANCE_MIN_STEPS or max(busy) < REBALANCE_MIN_BUSY * window:
            return None
        measured = [b / n for b, n in zip(busy, steps, strict=True)]
        found = resplit(plan, [self.speeds[n] for n in plan.node_ids], measured, self.unit_bytes)
        if found is None:
            return None
        new, corrected = found
        left = self._left.setdefault(plan.node_ids, set())
        if new.ranges in left:  # back to a split these nodes left: the measurements swing (they differ with the
            return None  # load's rows per step); going back and forth would rebuild the pipeline every period
        left.add(plan.ranges)
        self.speeds.update({n.node_id: n for n in corrected})
        self._counted.pop(pipeline.index, None)
        return new

    async def growth(self, pipelines: Sequence[Pipeline]) -> list[tuple[Pipeline | None, PipelinePlan]]:
        """Nodes alive and unused fill degraded pipelines first (fewer stages than asked), then form new
        replicas of full length.  Unpinned pipelines (tests, one node) never grow."""
        if any(not n for p in pipelines for n in p.plan.node_ids):
            return []
        alive = await self._usable()
        used = {n for p in pipelines for n in p.plan.node_ids}
        unused = {n: ip for n, ip in alive.items() if n not in used}
        # a node lost moments ago is still listed (its pipeline already gone): only the ones that answer count
        heard = await asyncio.wait_for(asyncio.to_thread(answering, list(unused)), NODE_ANSWER_TIMEOUT_S + 10)
        found = await self._speeds({n: ip for n, ip in unused.items() if n in heard})
        free = sorted(found.values(), key=lambda s: sum(s.unit_costs))  # fastest first
        # a node that cannot reach another (a cut between two workers) joins no pipeline with it; asked only when a
        # free node could join one (a degraded pipeline, enough for a new replica): not at every look of a fleet
        # that keeps a spare node
        degraded = any(p.state == "live" and len(p.plan.node_ids) < self.stages for p in pipelines)
        could = free and (degraded or len(free) >= self.stages or not pipelines)
        cuts = await self._cuts([*used, *(s.node_id for s in free)]) if could else set()
        changes: list[tuple[Pipeline | None, PipelinePlan]] = []
        for pipeline in pipelines:
            want = self.stages - len(pipeline.plan.node_ids)
            if pipeline.state != "live" or want <= 0 or not free:
                continue
            fits = set(connected([*pipeline.plan.node_ids, *(s.node_id for s in free)], cuts))
            taken = [s for s in free if s.node_id in fits][:want]
            if not taken:
                continue
            free = [s for s in free if s not in taken]
            own = [self.speeds[n] for n in pipeline.plan.node_ids if n in self.speeds]
            plan = replan(own, taken, self.stages, self.cfg.layers, self.unit_bytes)
            if plan is not None:
                changes.append((pipeline, plan))
        if cuts:  # new replicas only over free nodes that all reach each other
            keep = set(connected([s.node_id for s in free], cuts))
            free = [s for s in free if s.node_id in keep]
        if len(free) >= self.stages:
            for group in snake_groups(free, len(free) // self.stages, self.stages):
                changes.append((None, split_over(group, None, "a new replica over nodes that joined", self.unit_bytes)))
        elif free and not pipelines:
            plan = replan([], free, self.stages, self.cfg.layers, self.unit_bytes)
            changes += [(None, plan)] if plan is not None else []
        return changes


def capacity_s(now: dict[str, Any], before: dict[str, Any]) -> float:
    """A stage's seconds of work between two reads of its counters: its wall time inside forward, or, on a node with
    a CPU quota, its CPU time inside forward over that quota when that is longer.  A stage under a quota that waited
    for work computes its next step in a burst at full speed, so at a light load its wall time says the node is
    faster than it is under a steady one (the bench's capacity time, ``placement.balance``); judged by it, a window of
    one request at a time once moved a block onto the 0.25-CPU host, which then took 20 ms a step under load."""
    busy = float(now["busy_s"] - before["busy_s"])
    if "forward_cpu_s" not in now or "forward_cpu_s" not in before:
        return busy
    return capacity_time(busy, float(now["forward_cpu_s"] - before["forward_cpu_s"]), now.get("node_cpu_quota"))


async def _alive() -> dict[str, str]:
    return await asyncio.wait_for(asyncio.to_thread(alive_nodes), NODES_TIMEOUT_S)


def _kill(actors: Sequence[Any]) -> None:
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
