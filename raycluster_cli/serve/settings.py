"""What one text deployment serves and how: the checkpoint, its placement over stages, the batching and request limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from raycluster_cli.node.vllm_server import VllmLaunch
from raycluster_cli.placement.pipelines import NodeSpeed, PipelinePlan
from raycluster_cli.placement.vllm_split import VllmSplit
from raycluster_cli.serve.fleet import Calibration
from raycluster_cli.serve.frontdoor import RequestLimits
from raycluster_cli.serve.scheduler import Limits
from raycluster_cli.serve.stages import split_units


@dataclass(frozen=True)
class ServeSettings:
    """What one deployment serves and how: the checkpoint, its split over stages, the batching limits."""

    model_path: str
    model_id: str = ""  # the name clients pass as ``model``; default: the checkpoint folder's name
    keys_file: str | None = None  # the service's keys document (raycluster_cli.apikeys); None: no auth (tests only)
    key_max_requests: int | None = None  # requests in flight per key when its entry sets none (None: no bound)
    key_max_tokens: int | None = None  # tokens in flight per key when its entry sets none (None: no bound)
    max_ongoing: int = 256  # requests the ingress holds at once (Ray Serve's max_ongoing_requests)
    max_queued: int = 256  # requests Ray Serve queues for the ingress beyond those; past them 503 with Retry-After
    stages: int = 1
    split: tuple[int, ...] | None = None  # blocks per stage; None: even
    node_ids: tuple[str, ...] | None = None  # pin stage i to node i
    num_threads: int | None = None
    limits: Limits = field(default_factory=Limits)
    max_in_flight: int | None = None  # steps travelling through the pipeline at once; None: one per stage
    links: str = "direct"  # how a step travels between stages: "direct" links (node.links) or "ray" calls
    replicas: int = 1  # pipelines when ``plans`` is not given (each of ``split``, on ``node_ids``)
    plans: tuple[PipelinePlan, ...] = ()  # the placement (the launcher's, from measured node speeds)
    speeds: tuple[NodeSpeed, ...] = ()  # the nodes' measured unit costs, for re-plans without re-measuring
    calibration: Calibration | None = None  # how a node that joins later is measured
    replace_period_s: float = 30.0  # how often alive nodes no pipeline uses are looked for
    rebalance_period_s: float = 20.0  # how often the stages' times under load are judged for a re-split (0: never)
    unit_bytes: tuple[int, ...] = ()  # each unit's bytes (weights + KV slots): re-splits stay within memory
    stage_fixed_bytes: int = 0  # what a stage needs besides its units (a step's tensors, a tensor being read)
    failover_wait_s: float = 90.0  # how long a moved request waits for a pipeline to come back
    dtype: str = "float32"  # weights, KV cache and activations (resolved: never "auto")
    quantize: str = ""  # "int8": CPU stages' products with int8 weights (models.int8)
    request_limits: RequestLimits = field(default_factory=RequestLimits)  # one request's bounds (serve.frontdoor)
    vllm: VllmLaunch | None = None  # vLLM's servers generate instead of our pipelines (serve/vllm_engine.py)
    vllm_nodes: tuple[str, ...] = ()  # one vLLM replica on each of these nodes ("" = anywhere)
    vllm_pipelines: tuple[tuple[str, ...], ...] = ()  # one vLLM pipeline over each group, stage i on node i
    vllm_split: VllmSplit | None = None  # how the launcher chose that pipeline (its report)

    @property
    def served_model(self) -> str:
        return self.model_id or Path(self.model_path).name

    def pipeline_plans(self, layers: int) -> list[PipelinePlan]:
        """The placement: ``plans`` as given, else ``replicas`` copies of ``split`` on ``node_ids``."""
        if self.plans:
            return list(self.plans)
        ranges = tuple(split_units(layers, self.stages, self.split))
        nodes = self.node_ids or ("",) * len(ranges)
        why = "the split given" if self.split else "blocks split evenly (no measurements)"
        return [PipelinePlan(nodes, ("",) * len(ranges), ranges, why=why) for _ in range(self.replicas)]
