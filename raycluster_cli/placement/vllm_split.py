"""vLLM's pipeline settings from raycluster's measurements: the uneven layer split, one memory fraction, the KV room.

vLLM takes an uneven pipeline split (``VLLM_PP_LAYER_PARTITION``: one layer count per stage, summing to the
layers; stage 0 also holds the embedding, the last stage the LM head, as our units do) but computes none; this
module computes it with our min-max DP over each node's measured unit costs (``balanced_partition``), within
vLLM's own memory rules, which differ from our engine's:

- one ``gpu_memory_utilization`` for every rank: each rank may take that fraction of its device's total memory
  (on the CPU backend, of the host's: the flag keeps its name there), and refuses to start when the fraction is
  more than is free; so the fraction is the smallest free ÷ total among the nodes;
- every rank gets the same number of KV cache blocks (the engine takes the smallest rank's count), and a rank's
  block holds K and V of ``block_size`` positions for each of its own layers: a stage with more layers pays more
  per block, and the stage with the least room for its layers bounds the whole pipeline's concurrency;
- tensor parallel within a stage is its node's GPU count, and vLLM has one ``tensor_parallel_size`` for every
  stage: nodes with different GPU counts cannot be stages of one pipeline (``group_by_gpus`` groups them).

The KV tokens asked for (``kv_tokens``: the service's sequences at once × their context) are made a hard need of
every stage's every layer, which is exactly the coupling above, so the DP never picks a split whose tight stage
starves the others of concurrency.  Pure Python; what each node holds comes from ``cgroup.node_capacity`` and
``placement.memory``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raycluster_cli.models.config import ModelConfig
from raycluster_cli.placement.memory import gb, unit_bytes
from raycluster_cli.placement.partition import (
    DoesNotFit,
    balanced_partition,
    blocks_held,
    ranges_from_block_counts,
    stage_costs,
)
from raycluster_cli.placement.pipelines import NodeSpeed

BLOCK_SIZE = 16  # vLLM's default KV block size (positions per block)
MOST_ORDERED = 5  # up to this many stages every node order is tried; beyond, fastest first
MOST_UTILIZATION = 0.95  # never hand vLLM more of a device than this: its own default is 0.9 of the total


class MixedGpuCounts(ValueError):
    """The nodes of one vLLM pipeline have different GPU counts; the message names them and the fix."""


@dataclass(frozen=True)
class VllmNode:
    """One node as vLLM will use it: its measured unit costs, device memory and GPU count (0: CPU)."""

    speed: NodeSpeed
    total: int  # bytes of its device memory (all its GPUs together; CPU: the container's limit or the host's)
    free: int  # bytes free for vLLM now (after Ray, the margin: ``Capacity.usable``)
    gpus: int = 0


@dataclass(frozen=True)
class VllmSplit:
    """A vLLM pipeline over ``ips`` in that order: the environment and flags to start it with, and why."""

    node_ids: tuple[str, ...]
    ips: tuple[str, ...]
    layers: tuple[int, ...]  # VLLM_PP_LAYER_PARTITION
    tensor_parallel: int
    utilization: float  # --gpu-memory-utilization, one for every rank
    kv_blocks: int  # blocks every rank holds (the smallest stage's room)
    block_size: int
    bound_by: int  # the stage whose room sets kv_blocks
    stage_s: tuple[float, ...]  # modelled seconds per step of each stage, this split
    even_stage_s: tuple[float, ...]  # the same for vLLM's own split (``vllm_even_layers``), for the pilots to beat
    stage_kv_bytes: tuple[int, ...]  # KV bytes each stage holds at kv_blocks (CPU: VLLM_CPU_KVCACHE_SPACE)
    why: str

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    def env(self) -> dict[str, str]:
        """The environment every rank of this pipeline needs."""
        return {"VLLM_PP_LAYER_PARTITION": ",".join(str(n) for n in self.layers)}

    def flags(self) -> list[str]:
        """vLLM's command-line flags for this pipeline's shape."""
        return [
            f"--pipeline-parallel-size={len(self.layers)}",
            f"--tensor-parallel-size={self.tensor_parallel}",
            f"--gpu-memory-utilization={self.utilization:.2f}",
            f"--block-size={self.block_size}",
        ]

    def cpu_kv_gib(self, stage: int) -> int:
        """``VLLM_CPU_KVCACHE_SPACE`` (whole GiB, as vLLM reads it) for a CPU stage: its blocks, rounded up."""
        return max(1, math.ceil(self.stage_kv_bytes[stage] / (1 << 30)))

    def to_json(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers),
            "nodes": list(self.ips),
            "tensor_parallel": self.tensor_parallel,
            "gpu_memory_utilization": self.utilization,
            "kv_blocks": self.kv_blocks,
            "kv_tokens": self.kv_tokens,
            "bound_by_stage": self.bound_by,
            "stage_s": [round(s, 6) for s in self.stage_s],
            "even_stage_s": [round(s, 6) for s in self.even_stage_s],
            "why": self.why,
        }


def tensor_parallel(nodes: Sequence[VllmNode]) -> int:
    """The one tensor-parallel size of a pipeline over ``nodes``: their common GPU count (1 on CPUs)."""
    counts = {n.gpus for n in nodes}
    if len(counts) > 1:
        named = ", ".join(f"{n.speed.ip or n.speed.node_id} {n.gpus} GPU(s)" for n in nodes)
        raise MixedGpuCounts(
            f"vLLM runs one tensor-parallel size on every pipeline stage, and these nodes differ: {named}; serve"
            " one vLLM replica per GPU count (nodes grouped by it) or --engine ours, which takes any mix"
        )
    return max(1, counts.pop() if counts else 1)


def group_by_gpus(nodes: Sequence[VllmNode]) -> list[list[VllmNode]]:
    """The nodes in groups of one GPU count, each a candidate vLLM pipeline, most GPUs first, order kept within."""
    groups: dict[int, list[VllmNode]] = {}
    for node in nodes:
        groups.setdefault(node.gpus, []).append(node)
    return [groups[count] for count in sorted(groups, reverse=True)]


def vllm_even_layers(layers: int, stages: int) -> list[int]:
    """vLLM's own split without ``VLLM_PP_LAYER_PARTITION`` (``vllm.distributed.utils.get_pp_indices``): the
    remainder goes one layer each to the stages before the last, from the last but one backwards."""
    counts = [layers // stages] * stages
    for i in range(2, layers % stages + 2):
        counts[-i] += 1
    return counts


def utilization(nodes: Sequence[VllmNode]) -> float:
    """The one fraction every rank may take: the smallest free ÷ total, rounded down to a hundredth."""
    if any(n.total <= 0 for n in nodes):
        raise ValueError("every node needs its total memory (bytes > 0) for vLLM's --gpu-memory-utilization")
    fraction = min(n.free / n.total for n in nodes)
    return min(MOST_UTILIZATION, math.floor(fraction * 100) / 100)


def kv_room(
    cfg: ModelConfig, ranges: Sequence[tuple[int, int]], rooms: Sequence[float], block_size: int
) -> tuple[int, int]:
    """(blocks every rank can hold, the stage that bounds it) for stages holding ``ranges`` within ``rooms``."""
    weights = unit_bytes(cfg)
    per_layer = cfg.kv_bytes(block_size)
    counts = []
    for (start, end), room in zip(ranges, rooms, strict=True):
        layers = blocks_held(start, end, cfg.layers)
        left = room - sum(weights[start:end])
        counts.append(max(0, math.floor(left / (layers * per_layer))) if layers else 0)
    bound = min(range(len(counts)), key=lambda s: counts[s])
    return counts[bound], bound


def vllm_split(
    cfg: ModelConfig,
    nodes: Sequence[VllmNode],
    kv_tokens: int,
    block_size: int = BLOCK_SIZE,
    reserve: int = 0,
) -> VllmSplit:
    """vLLM's pipeline over ``nodes`` in the order given (stage i on node i): layers by measured speed, every stage
    holding ``kv_tokens`` positions of KV for each of its layers within the one memory fraction.

    ``reserve``: bytes each rank keeps beside weights and KV (vLLM's activation peak at its batch size, the
    runtime).  ``DoesNotFit`` (with the numbers and the fix) when no split holds ``kv_tokens``."""
    if not nodes:
        raise ValueError("a vLLM pipeline needs at least one node")
    if kv_tokens < 1 or block_size < 1:
        raise ValueError(f"kv_tokens and block_size must be positive, got {kv_tokens} and {block_size}")
    tp = tensor_parallel(nodes)
    share = utilization(nodes)
    rooms = [share * n.total - reserve for n in nodes]
    whole_blocks = math.ceil(kv_tokens / block_size) * block_size
    kv = cfg.kv_bytes(whole_blocks)
    sizes = [float(w + (kv if 0 < u <= cfg.layers else 0)) for u, w in enumerate(unit_bytes(cfg))]
    costs = [list(n.speed.unit_costs) for n in nodes]
    try:
        ranges = balanced_partition(costs, unit_bytes=sizes, capacity=rooms)
    except DoesNotFit:
        raise DoesNotFit(
            f"vLLM's pipeline over {len(nodes)} node(s) cannot hold the model with {whole_blocks} KV positions on"
            f" every layer ({gb(sum(sizes))} at {cfg.dtype}) within {share:.2f} of each node's memory ("
            + ", ".join(f"{n.speed.ip} {gb(r)}" for n, r in zip(nodes, rooms, strict=True))
            + "): ask for fewer sequences at once or a shorter context, use --dtype bfloat16, or add nodes"
        ) from None
    blocks, bound = kv_room(cfg, ranges, rooms, block_size)
    layers = tuple(blocks_held(a, b, cfg.layers) for a, b in ranges)
    even = ranges_from_block_counts(vllm_even_layers(cfg.layers, len(nodes)))
    ips = [n.speed.ip or n.speed.node_id for n in nodes]
    why = (
        f"layers {','.join(map(str, layers))} over {', '.join(ips)} by each node's measured unit costs (min-max),"
        f" every layer holding {whole_blocks} KV positions within {share:.2f} of each node's memory (the smallest"
        f" free ÷ total); stage {bound} ({ips[bound]}) bounds the KV room: {blocks} blocks of {block_size}"
    )
    return VllmSplit(
        node_ids=tuple(n.speed.node_id for n in nodes),
        ips=tuple(ips),
        layers=layers,
        tensor_parallel=tp,
        utilization=share,
        kv_blocks=blocks,
        block_size=block_size,
        bound_by=bound,
        stage_s=tuple(stage_costs(costs, ranges)),
        even_stage_s=tuple(stage_costs(costs, even)),
        stage_kv_bytes=tuple(n * cfg.kv_bytes(blocks * block_size) for n in layers),
        why=why,
    )


def best_pipeline(
    cfg: ModelConfig, nodes: Sequence[VllmNode], stages: int, kv_tokens: int, block_size: int = BLOCK_SIZE
) -> VllmSplit:
    """One vLLM pipeline over the ``stages`` fastest of ``nodes`` (by measured cost), in the node order whose split
    has the fastest slowest stage (every order up to ``MOST_ORDERED`` stages: the first stage also holds the
    embedding and the last the LM head, so which node ends the pipeline matters; fastest first beyond)."""
    if not 1 <= stages <= len(nodes):
        raise ValueError(f"--stages {stages}: a vLLM pipeline needs 1 to {len(nodes)} stage(s) over these nodes")
    chosen = sorted(nodes, key=lambda n: (sum(n.speed.unit_costs), n.speed.ip, n.speed.node_id))[:stages]
    orders = itertools.permutations(chosen) if stages <= MOST_ORDERED else [tuple(chosen)]
    best: VllmSplit | None = None
    failure: DoesNotFit | None = None
    for order in orders:
        try:
            split = vllm_split(cfg, order, kv_tokens, block_size)
        except DoesNotFit as exc:
            failure = failure or exc
            continue
        if best is None or (max(split.stage_s), -split.kv_blocks) < (max(best.stage_s), -best.kv_blocks):
            best = split
    if best is None:
        raise failure or DoesNotFit("no vLLM pipeline fits these nodes")
    return best
