"""The live state of one benchmark: nodes, stage workers, calibrated costs, lost replicas.

``run`` drives a ``Session`` through its phases; every phase reports progress through
the callback it was given (``phase, done, total``), and every workload run goes through
``measure``, which skips replicas that lost a node earlier and records the ones that lose one now.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

from raycluster_cli.bench import experiment, fitting, pilots, planning, workload
from raycluster_cli.bench.options import BenchOptions
from raycluster_cli.models.decoder import prefill_chunks
from raycluster_cli.node import stage_worker as pipeline
from raycluster_cli.node.nodes import alive_nodes, gpu_counts
from raycluster_cli.placement import memory
from raycluster_cli.schema import SCHEMA_VERSION

log = logging.getLogger("raycluster.bench")
Ranges = list[list[tuple[int, int]]]
# The counted run has at least this many times a pilot's least requests: 2 x (stages + 1) micro-batches per
# replica, all in flight from the start (offline, fewer than 4 x stages are admitted at once:
# planning.in_flight_limit), so the stages idle only in the first and last step's fill and drain (measured:
# a run sized to 4 micro-batches on 3 stages idled its busiest stage 3.4 s of 17.6 s). It was 4 until the
# default model grew 3x deeper: a run lasts its calls times a call's compute, and the deeper
# model is what makes Ray's per-call overhead small (see size_model).
COUNTED_FLOOR = 2


@dataclass
class Session:
    options: BenchOptions
    progress: experiment.Report
    nodes: list[dict[str, Any]]
    num_stages: int
    node_ids: list[str]  # node of each worker, replica by replica
    workers: list[Any]
    cfg: Any
    gpu_nodes: set[str]
    params: Any = None
    calibrations: dict[str, dict[str, Any]] = field(default_factory=dict)
    costs: dict[str, list[float]] = field(default_factory=dict)
    hops: dict[str, Any] = field(default_factory=dict)
    transfer_s: float = 0.0
    pilots: list[dict[str, Any]] = field(default_factory=list)
    lost: list[dict[str, Any]] = field(default_factory=list)
    dead: set[int] = field(default_factory=set)  # replicas that lost a node
    balanced_ranges: Ranges | None = None
    extra_workers: list[Any] = field(default_factory=list)  # started by --sweep nodes
    dtype_choice: dict[str, Any] = field(default_factory=dict)
    memory: fitting.MemoryPlan | None = None  # each node's room and what the model needs (None: not measured)

    @classmethod
    def start(cls, options: BenchOptions, progress: experiment.Report) -> Session:
        experiment.model_config(options, options.layers or 4)  # a bad checkpoint fails before Ray is touched
        if not ray.is_initialized():  # tests may hand over a Ray they started themselves
            ray.init(address="auto", logging_level=logging.ERROR, log_to_driver=False)
        nodes = alive_nodes()
        manual = options.manual_counts
        num_stages = options.stages or (len(manual) if manual else None) or len(nodes)
        provisional = options.layers or (sum(manual) if manual else max(4, num_stages))
        plan = planning.replica_nodes(len(nodes), num_stages, options.replicas, options.allow_shared_nodes)
        gpus = gpu_counts(nodes)
        gpu_nodes = set(gpus)
        node_ids = [nodes[i]["node_id"] for replica in plan for i in replica]
        cfg = experiment.model_config(options, provisional, on_gpu=set(node_ids) <= gpu_nodes)
        if num_stages > cfg.layers and (options.layers or options.model_path):
            raise ValueError(f"{num_stages} stages but the model has {cfg.layers} blocks: every stage needs one")
        fitting.refuse_early(options, cfg, nodes, node_ids, num_stages, gpu_nodes)
        log.info("replicas on %s", [[nodes[i]["node_ip"] for i in replica] for replica in plan])
        progress(f"starting {len(node_ids)} stage worker(s) on {len(set(node_ids))} node(s)")
        workers = pipeline.start_workers(
            cfg,
            node_ids,
            num_threads=options.threads,
            allow_shared_nodes=options.allow_shared_nodes,
            gpu_nodes=gpus,  # each node's GPUs shared out among its stages
        )
        session = cls(options, progress, nodes, num_stages, node_ids, workers, cfg, gpu_nodes)
        try:
            on_cpu = not set(node_ids) <= gpu_nodes
            session.plan_memory("bfloat16" if options.dtype == "auto" and on_cpu else None)  # before any weights
            session.choose_dtype()
            session.plan_memory()
            session.calibrate()
            session.size_model()
            session.measure_hops()
        except BaseException:
            session.stop()
            raise
        return session

    @property
    def replicas(self) -> list[list[Any]]:
        s = self.num_stages
        return [self.workers[r * s : (r + 1) * s] for r in range(len(self.workers) // s)]

    def alive(self) -> list[int]:
        return [r for r in range(len(self.replicas)) if r not in self.dead]

    def node_ip(self, node_id: str) -> str:
        return next((str(n["node_ip"]) for n in self.nodes if n["node_id"] == node_id), node_id)

    def choose_dtype(self) -> None:
        """``--dtype auto`` on CPU nodes: bfloat16 when one block measured faster in it on every node."""
        o = self.options
        if o.dtype != "auto" or set(self.node_ids) <= self.gpu_nodes:
            why = "as asked" if o.dtype != "auto" else "the checkpoint's dtype on GPU nodes"
            self.dtype_choice = {"requested": o.dtype, "dtype": self.cfg.dtype, "why": why}
            return
        from raycluster_cli.models import precision

        self.progress("measuring a block in float32 and bfloat16 on every node (--dtype auto)")
        probes = precision.probe(list(self.first_on_node().values()), o)
        self.dtype_choice = {"requested": "auto", **precision.choose(list(probes))}
        if self.dtype_choice["dtype"] != self.cfg.dtype:
            self.cfg = experiment.model_config(o, self.cfg.layers, dtype=self.dtype_choice["dtype"])
            ray.get([w.configure.remote(self.cfg.to_dict()) for w in self.workers])

    def plan_memory(self, dtype: str | None = None) -> None:
        """Measure every node's room (once) and refuse a model no split can hold, at ``dtype`` (default: the run's)."""
        if self.memory is None:
            found = ray.get([w.memory_capacity.remote() for w in self.first_on_node().values()])
            self.memory = fitting.MemoryPlan.make(self.cfg, self.options, self.num_stages, list(found))
        cfg = self.cfg if dtype is None else dataclasses.replace(self.cfg, dtype=dtype)
        self.memory = self.memory.for_config(cfg, self.options, self.num_stages)
        self.memory.refuse_if_too_large(self.num_stages)

    def first_on_node(self) -> dict[str, Any]:
        """One worker per distinct node (the first of each)."""
        first: dict[str, Any] = {}
        for node_id, worker in zip(self.node_ids, self.workers, strict=True):
            first.setdefault(node_id, worker)
        return first

    def calibrate(self) -> None:
        """Every node's per-unit-type cost, all nodes at once (one worker per distinct node)."""
        first_on_node = self.first_on_node()
        o = self.options
        self.progress(f"calibrating {len(first_on_node)} node(s)")
        found = pipeline.calibrate_workers(
            list(first_on_node.values()),
            o.micro_batch,
            o.prompt_len,
            max(1, o.max_new_tokens - 1),
            o.calibration_repeats,
            o.calibration_sample_s,
            o.prefill_chunk,
            [self.memory.calibration_blocks(n) if self.memory else 4 for n in first_on_node],
        )
        self.calibrations = dict(zip(first_on_node, found, strict=True))

    def size_model(self) -> None:
        """``--layers`` left out: enough blocks that the slowest node gets its share; then the cost rows.

        Ray's own handling of each call on a stage's node (taking the micro-batch in, sending the result out:
        about 3 ms of CPU per call at full speed) is outside the stage's clock T_i and costs a slow node a
        larger share of its time. Measured on hosts at 1.0/0.25/0.25 CPU (one run each): with the
        slowest node holding 14 blocks it was 12% of that node's CPU and the wall-clock imbalance 0.24; with 44
        blocks, 4% and 0.02 (--min-blocks-per-node, 48 by default).
        """
        o = self.options
        if not o.layers and not o.model_path and not o.manual_counts:
            rows = [
                [
                    float(self.calibrations[n]["block_s"])
                    for n in self.node_ids[r * self.num_stages :][: self.num_stages]
                ]
                for r in range(len(self.replicas))
            ]
            layers = max(experiment.auto_layers(rows, o.min_blocks_per_node), self.num_stages)
            self.cfg = experiment.model_config(o, layers, dtype=self.cfg.dtype)
            self.progress(f"model sized to {layers} blocks (slowest node holds about {o.min_blocks_per_node})")
            ray.get([w.configure.remote(self.cfg.to_dict()) for w in self.workers])
            self.plan_memory()
        self.costs = {nid: pipeline.unit_cost_row(c, self.cfg.layers) for nid, c in self.calibrations.items()}

    def measure_hops(self) -> None:
        """What one stage boundary costs with no-op stages, for a prefill piece and for a decode step."""
        o = self.options
        self.progress("measuring the per-hop overhead with no-op stages")
        chunks = prefill_chunks(o.prompt_len, o.prefill_chunk)
        first = self.replicas[0]
        dtype = getattr(torch, self.cfg.dtype)  # activations travel in the model's dtype
        prefill = pipeline.hop_overhead(
            first, torch.zeros(o.micro_batch, chunks[0][1], self.cfg.d_model, dtype=dtype), hops=o.hops
        )
        decode = pipeline.hop_overhead(first, torch.zeros(o.micro_batch, 1, self.cfg.d_model, dtype=dtype), hops=o.hops)
        self.hops = {
            "prefill": prefill,
            "decode": decode,
            "hops": o.hops,
            "per_hop_s": decode["per_hop_s"],
            "per_hop_direct_s": decode["per_hop_direct_s"],
            "per_hop_via_driver_s": decode["per_hop_via_driver_s"],
        }
        decode_steps = max(1, o.max_new_tokens - 1)
        self.transfer_s = len(chunks) * prefill["per_hop_s"] + decode_steps * decode["per_hop_s"]

    def ranges_for(self, which: str) -> Ranges:
        """Every replica's split; the balanced one fits each node's memory, another that does not raises
        ``memory.ModelTooLarge`` with the reason."""
        out = []
        for r in range(len(self.replicas)):
            ids = self.node_ids[r * self.num_stages :][: self.num_stages]
            rows = [self.costs[n] for n in ids]
            if which == "balanced" and self.memory is not None:
                out.append(self.memory.balanced(rows, self.transfer_s, ids))
                continue
            ranges = experiment.choose_ranges(which, rows, self.cfg.layers, self.transfer_s)
            why = self.memory.why_not(ranges, ids) if self.memory is not None else None
            if why:
                raise memory.ModelTooLarge(f"the {which.split(':')[0]} split does not fit the nodes' memory: {why}")
            out.append(ranges)
        return out

    def measure(self, ranges: Ranges, params: Any, label: str, replicas: list[list[Any]] | None = None) -> Any:
        """One workload run on the replicas still alive (or on ``replicas``); records nodes it loses."""
        alive = self.alive() if replicas is None else list(range(len(replicas)))
        group = [self.replicas[r] for r in alive] if replicas is None else replicas
        chosen = [ranges[r] for r in alive]
        self.progress(label)
        workload.setup_replicas(group, chosen)

        def report(step: str, done: int | None = None, total: int | None = None, **extra: Any) -> None:
            self.progress(label, done, total, step=step, **extra)

        result = workload.run_workload(group, chosen, self.cfg, params, report)
        if replicas is None:
            for stage in result.stages:
                stage.replica = alive[stage.replica]
            for rep in result.replicas:
                rep.index = alive[rep.index]
            for lost in result.lost:
                lost.replica = alive[lost.replica]
                self.dead.add(lost.replica)
                self.lost.append({"phase": label, **asdict(lost)})
        return result

    def estimate_requests(self, ranges: Ranges, duration_s: float) -> int:
        """Requests for ``duration_s`` at the throughput the calibration predicts for ``ranges``."""
        bottleneck = max(
            sum(self.costs[self.node_ids[r * self.num_stages + s]][a:b]) + self.transfer_s
            for r in range(len(ranges))
            for s, (a, b) in enumerate(ranges[r])
        )
        o = self.options
        tokens_per_s = len(self.alive()) * o.micro_batch * o.max_new_tokens / max(bottleneck, 1e-9)
        return experiment.requests_for(duration_s, tokens_per_s, o, self.least_requests())

    def least_requests(self) -> int:
        return self.options.micro_batch * max(1, len(self.alive())) * (self.num_stages + 1)

    def choose_split(self) -> tuple[Ranges, dict[str, Any]]:
        """Pilots (balanced), the even split's own pilot, and the size of the counted run."""
        o = self.options
        ranges = self.ranges_for(o.partition)
        auto = o.requests is None
        pilot_params = experiment.bench_params(o, o.requests or self.estimate_requests(ranges, o.duration_s / 2))
        self.params = experiment.bench_params(o, o.requests or pilot_params.requests)
        pilot_params = experiment.replace_params(pilot_params, rate=None)  # pilots run offline
        if o.partition != "balanced" or not o.refine:
            if auto:
                sizing = self.measure(
                    ranges,
                    experiment.replace_params(
                        pilot_params, requests=max(self.least_requests(), pilot_params.requests // 2)
                    ),
                    "sizing run",
                )
                self.resize(sizing.tokens_per_s)
            return ranges, {"used": o.partition, "reason": "no pilots" if o.partition == "balanced" else "asked for"}

        def run_pilot(rr: Ranges, index: int) -> Any:
            nonlocal pilot_params
            result = self.measure(rr, pilot_params, f"pilot {index + 1}/{o.refine}")
            if auto and index == 0:
                self.resize(result.tokens_per_s)
                pilot_params = experiment.replace_params(
                    pilot_params, requests=max(self.least_requests(), self.params.requests // 2)
                )
            return result

        chosen, tried = pilots.refine(ranges, o.refine, run_pilot, self.costs, lambda: self.ranges_for("balanced"))
        self.balanced_ranges = chosen
        self.pilots = pilots.public(tried, chosen, {nid: self.node_ip(nid) for nid in self.costs})
        try:
            even = self.ranges_for("even")
        except memory.ModelTooLarge as exc:
            return chosen, {"used": "balanced", "reason": str(exc)}
        used, choice = pilots.pick_split(
            chosen, even, tried, lambda: self.measure(even, pilot_params, "even-split pilot")
        )
        return used, choice

    def resize(self, tokens_per_s: float) -> None:
        """The counted run's requests from a measured throughput (``--requests`` left out)."""
        o = self.options
        # Never fewer than COUNTED_FLOOR x a pilot's least requests (why: at COUNTED_FLOOR).
        requests = experiment.requests_for(o.duration_s, tokens_per_s, o, COUNTED_FLOOR * self.least_requests())
        self.params = experiment.replace_params(self.params, requests=requests)
        expected_s = requests * o.max_new_tokens / max(tokens_per_s, 1e-9)
        self.progress(f"counted run sized to {requests} requests (about {expected_s:.0f}s at {tokens_per_s:.1f} tok/s)")

    def main_doc(self, result: Any, ranges: Ranges) -> dict[str, Any]:
        replicas = result.replica_dicts()
        stages = result.stage_dicts()
        return {
            **({"memory": self.memory.report(stages)} if self.memory is not None else {}),
            **result.summary(),
            "stages": experiment.with_predictions(result.stage_dicts(), self.costs, replicas),
            "replicas": replicas,
            "lost_in_run": result.lost_dicts(),
            "partition_ranges": [[list(r) for r in rr] for rr in ranges],
        }

    def references(self, result: Any, ranges: Ranges, choice: dict[str, Any]) -> dict[str, Any]:
        from raycluster_cli.bench.references import references

        return references(self, result, ranges, choice)

    def sweep(self, kind: str, ranges: Ranges) -> dict[str, Any]:
        if kind == "batch":
            return experiment.sweep_batch(
                lambda size: self.measure(
                    ranges, experiment.replace_params(self.params, micro_batch=size), f"sweep: micro-batch {size}"
                ),
                self.params.requests,
                self.options.sweep_max_batch,
            )
        from raycluster_cli.bench.sweeps import sweep_nodes

        return sweep_nodes(self, ranges)

    def stop(self) -> None:
        pipeline.stop_workers(self.workers + self.extra_workers)

    def calibration_doc(self) -> dict[str, Any]:
        return {
            "calibration": {
                "nodes": list(self.calibrations.values()),
                "refinements": self.pilots,
                "transfer_s_per_micro_batch": self.transfer_s,
            },
            "hop_overhead": self.hops,
        }

    def config_doc(self, first_ranges: list[list[int]]) -> dict[str, Any]:
        from raycluster_cli.bench.references import config_doc

        return config_doc(self, first_ranges)


def run(options: BenchOptions, progress: experiment.Report) -> dict[str, Any]:
    """One benchmark invocation (what ``python -m raycluster_cli.bench.driver`` runs in the head's container): the
    JSON-ready result document."""
    if options.model_path and (Path(options.model_path) / "model_index.json").is_file():
        from raycluster_cli.bench import images  # a diffusers checkpoint: image generation

        return images.run(options, progress)
    options = options.effective()
    started = time.perf_counter()
    session = Session.start(options, progress)
    try:
        ranges, choice = session.choose_split()
        params = session.params
        result = session.measure(ranges, params, "counted run")
        doc = session.main_doc(result, ranges)
        doc["split_choice"] = choice
        if options.check_output:
            progress("checking output against the unsharded model")
            from raycluster_cli.bench.outputcheck import check_output
            from raycluster_cli.node.cgroup import node_capacity

            room = node_capacity("driver", "driver").usable
            doc["output_check"] = check_output(session.cfg, params, result, options.check_requests, room)
        doc["references"] = session.references(result, ranges, choice)
        if options.sweep:
            doc["sweep"] = session.sweep(options.sweep, ranges)
    finally:
        session.stop()
    doc.update(session.calibration_doc())
    doc["lost_nodes"] = session.lost
    doc["total_s"] = time.perf_counter() - started
    doc["config"] = session.config_doc(doc["partition_ranges"][0])
    return {"schema_version": SCHEMA_VERSION, "ok": True, **doc}
