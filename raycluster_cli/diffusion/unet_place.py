"""Where a UNet cut by blocks goes: measured seconds per unit on each node, memory as a hard limit, the skip
activations charged at every cut.

``placing.place`` hands over when no node holds the UNet.  Each node then times the text encoder, the VAE decoder
and every UNet unit it can hold (``unet_workers.UNetProbe``, one unit in memory at a time), and ``search`` tries
every contiguous cut of the units into stages on distinct nodes, with the text encoder and the VAE decoder on any
node, keeping the plan whose busiest node has the least work per image (then the most even one), as the text split
does with ``partition.balanced_partition``.  A node's work per image is its parts' seconds, a UNet stage's once per
denoising step, each cut adding its carry's serialisation to the sender and its deserialisation to the receiver
(measured on the nodes themselves); a node's memory is its parts' weights with ``WEIGHT_HEADROOM``, the
activations, and the carries in and out of its stage (the down blocks' residuals the up blocks consume, which make
a cut in the middle of the UNet the most expensive one to carry).  Seconds are capacity time under a CPU quota
(``balance.capacity_time``), so probing every node at once on shared cores does not read contention as speed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from raycluster_cli.diffusion import unet_cut
from raycluster_cli.diffusion.parts import ImageRequest, vae_scale_factor
from raycluster_cli.placement import balance

MIB = 1024 * 1024


@dataclass(frozen=True)
class NodeCosts:
    """One node's room and measured seconds (per call) of each part; None where the part does not fit it."""

    node_id: str
    node_ip: str
    capacity: int
    text_s: float
    vae_s: float
    unit_s: list[float | None]
    send_s: list[float] = field(default_factory=list)  # the carry after unit i, serialised here
    recv_s: list[float] = field(default_factory=list)  # the carry after unit i, deserialised here


@dataclass
class CutPlan:
    text: str
    stages: list[tuple[str, int, int]]  # (node id, first unit, end unit)
    vae: str
    busy_s: dict[str, float]  # predicted busy seconds per image, by node id
    memory: dict[str, int]  # bytes planned on each node


def seconds(row: dict[str, Any] | None, quota: float | None, threads: int, wall: str = "wall_s") -> float | None:
    """A probe's reading as capacity time (``balance.capacity_time``), else its wall clock."""
    if row is None:
        return None
    cpu = row.get(wall.replace("wall", "cpu"))
    if quota and cpu is not None:
        return balance.capacity_time(float(cpu) / max(1, threads), float(cpu), quota)
    return float(row[wall])


def node_costs(probe: dict[str, Any], node_ip: str, capacity: int) -> NodeCosts:
    quota, threads = probe.get("cpu_quota"), int(probe.get("num_threads") or 1)
    units = probe["units"]
    return NodeCosts(
        probe["node_id"], node_ip, capacity,
        seconds(probe["text"], quota, threads) or 0.0, seconds(probe["vae"], quota, threads) or 0.0,
        [seconds(u, quota, threads) for u in units],
        [seconds(u, quota, threads, "put_wall_s") or 0.0 if u and "put_wall_s" in u else 0.0 for u in units[:-1]],
        [seconds(u, quota, threads, "get_wall_s") or 0.0 if u and "get_wall_s" in u else 0.0 for u in units[:-1]],
    )  # fmt: skip


def search(
    nodes: list[NodeCosts],
    unit_bytes: list[int],
    crossing: list[int],
    needs: dict[str, int],
    steps: int,
    headroom: float,
) -> CutPlan:
    """The best cut: every contiguous split of the units into 1..len(nodes) stages (each with a block) on distinct
    nodes in every order, the text encoder and VAE decoder on every node; least max node busy, then least sum of
    squares.  ``needs``: the text and vae parts' bytes and ``act``, a UNet stage's activations.
    ``ValueError`` with the numbers when nothing fits."""
    count = len(unit_bytes)
    best: tuple[tuple[float, float], CutPlan] | None = None
    for k in range(1, min(len(nodes), count - 2) + 1):
        for cuts in itertools.combinations(range(2, count - 1), k - 1):  # a stage ends after a block
            bounds = [0, *cuts, count]
            spans = list(itertools.pairwise(bounds))
            for order in itertools.permutations(nodes, k):
                stage_busy, stage_mem = _stages(order, spans, unit_bytes, crossing, needs["act"], steps, headroom)
                if stage_busy is None:
                    continue
                for text, vae in itertools.product(nodes, nodes):
                    busy = {n.node_id: 0.0 for n in nodes}
                    mem = {n.node_id: 0 for n in nodes}
                    for n, b, m in zip(order, stage_busy, stage_mem, strict=True):
                        busy[n.node_id] += b
                        mem[n.node_id] += m
                    busy[text.node_id] += text.text_s
                    busy[vae.node_id] += vae.vae_s
                    mem[text.node_id] += needs["text"]
                    mem[vae.node_id] += needs["vae"]
                    if any(mem[n.node_id] > n.capacity for n in nodes):
                        continue
                    score = (max(busy.values()), sum(v * v for v in busy.values()))
                    if best is None or score < best[0]:
                        plan_stages = [(n.node_id, a, b) for n, (a, b) in zip(order, spans, strict=True)]
                        best = (score, CutPlan(text.node_id, plan_stages, vae.node_id, busy, mem))
    if best is None:
        rooms = "; ".join(f"{n.node_ip} {n.capacity // MIB} MiB" for n in nodes)
        largest = max(unit_bytes)
        raise ValueError(
            f"no cut of the UNet by blocks fits the nodes' memory (nodes: {rooms}): its units take "
            f"{sum(unit_bytes) // MIB} MiB, the largest {largest // MIB} MiB, each stage also "
            f"{needs['act'] // MIB} MiB of activations and its carries: add memory or nodes"
        )
    return best[1]


def _stages(
    order: tuple[NodeCosts, ...],
    spans: list[tuple[int, int]],
    unit_bytes: list[int],
    crossing: list[int],
    act: int,
    steps: int,
    headroom: float,
) -> tuple[list[float] | None, list[int]]:
    busy: list[float] = []
    mem: list[int] = []
    last = len(unit_bytes)
    for node, (a, b) in zip(order, spans, strict=True):
        costs = node.unit_s[a:b]
        if any(c is None for c in costs):
            return None, []
        call = sum(c for c in costs if c is not None)
        call += node.send_s[b - 1] if b < last else 0.0
        call += node.recv_s[a - 1] if a > 0 else 0.0
        carries = (crossing[a - 1] if a > 0 else 0) + (crossing[b - 1] if b < last else 0)
        busy.append(call * steps)
        mem.append(int(sum(unit_bytes[a:b]) * headroom) + act + carries)
    return busy, mem


def crossing_for(path: str, request: ImageRequest) -> list[int]:
    """The carry's bytes after each unit, for one UNet call of this request (guidance doubles the batch)."""
    config = unet_cut.load_config(path)
    factor = vae_scale_factor(path)
    batch = request.n * (2 if request.guidance > 1.0 else 1)
    dim = config.get("cross_attention_dim", 768)
    dim = dim[0] if isinstance(dim, list) else int(dim)
    return unet_cut.crossing_bytes(path, batch, request.height // factor, request.width // factor, 8, dim)


def place_cut(
    path: str, rooms: list[Any], request: ImageRequest, needs: dict[str, int], headroom: float, threads: int | None
) -> tuple[CutPlan, dict[str, Any], str]:
    """Probe every node, search the cut; the plan, what it was chosen from, and why in words."""
    import ray

    from raycluster_cli.diffusion.unet_workers import UNetProbe, _pinned

    unet_cut.check_supported(unet_cut.load_config(path))
    sizes = unet_cut.unit_bytes(path)
    names, unit_bytes = list(sizes), list(sizes.values())
    crossing = crossing_for(path, request)
    actors, probes = [], []
    for room in rooms:
        fits = [int(b * headroom) + needs["act"] <= room.capacity for b in unit_bytes]
        actors.append(_pinned(UNetProbe, room.node_id).remote(threads))
        probes.append(actors[-1].measure.remote(path, request, fits))
    try:
        measured = ray.get(probes, timeout=1800)
    finally:
        for actor in actors:  # their processes would keep torch and the last unit's memory on every node
            ray.kill(actor)
    nodes = [node_costs(m, r.node_ip, r.capacity) for m, r in zip(measured, rooms, strict=True)]
    plan = search(nodes, unit_bytes, crossing, needs, request.steps, headroom)
    ip = {n.node_id: n.node_ip for n in nodes}
    stages = "; ".join(f"{ip[n]}: {', '.join(names[a:b])}" for n, a, b in plan.stages)
    cuts = ", ".join(f"{crossing[b - 1] / 1024:.1f} KiB after {names[b - 1]}" for _, _, b in plan.stages[:-1])
    why = (
        f"no node holds the UNet ({int(sum(unit_bytes) * headroom + needs['act']) // MIB} MiB with activations; "
        f"nodes: {'; '.join(f'{r.node_ip} {r.capacity // MIB} MiB' for r in rooms)}): the UNet cut by blocks into "
        f"{len(plan.stages)} stage(s) by each node's measured seconds per unit and its memory ({stages}), the carry "
        f"per UNet call {cuts or 'none'}; text encoder on {ip[plan.text]}, VAE decoder on {ip[plan.vae]}; predicted "
        "busy per image "
        + ", ".join(f"{ip[n]} {s:.3f} s" for n, s in sorted(plan.busy_s.items(), key=lambda i: ip[i[0]]))
    )
    detail = {
        "units": names,
        "unit_mib": [round(b / MIB, 3) for b in unit_bytes],
        "carry_kib": [round(c / 1024, 1) for c in crossing],
        "stages": [{"node_ip": ip[n], "units": names[a:b]} for n, a, b in plan.stages],
        "nodes": [
            {"node_ip": ip[n], "predicted_busy_s": s, "planned_mib": round(plan.memory[n] / MIB, 2)}
            for n, s in plan.busy_s.items()
        ],
        "probes": [
            {
                "node_ip": n.node_ip,
                "text_s": n.text_s,
                "vae_s": n.vae_s,
                "unit_s": n.unit_s,
                "send_s": n.send_s,
                "recv_s": n.recv_s,
                "cpu_quota": m.get("cpu_quota"),
                "num_threads": m.get("num_threads"),
            }
            for n, m in zip(nodes, measured, strict=True)
        ],
    }
    return plan, detail, why
