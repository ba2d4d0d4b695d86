"""``bench`` on a diffusers checkpoint: image generation placed and routed by measured speed and memory.

Placement (``place``): every node whose memory holds the whole pipeline gets a replica of it; when none does,
the parts become pipeline stages on three nodes (text encoder | UNet | VAE decoder), each where it fits, the UNet
first onto the node with the most CPU that holds it; when no node holds even the UNet (``CutNeeded``),
``unet_place`` cuts it by blocks across the nodes from their measured seconds per block (``unet_cut``,
``unet_workers``).  A node's memory (``node_rooms``) is the least of Ray's `memory` resource and what its container
can still give a part's worker (its cgroup limit less what is in use, as for text: ``cgroup.node_capacity``), so a
container memory limit below the whole pipeline places its parts apart instead of an out-of-memory kill.  Each replica is timed on
a calibration image; the images then go through the image service's router (``image_pool``): each to a replica
only when it can start there, so a replica 4× faster makes 4× the images whatever the calibration said, and the
last ones land where they finish first.  The report, as for
text: images/s, seconds per image p50/p90/p99, each node's busy time T_i, T_max − T_min and imbalance, and the
same requests routed equally and on the fastest node alone as references, and the pipeline ceiling (``ceiling``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from raycluster_cli.bench.experiment import Report
from raycluster_cli.bench.options import BenchOptions
from raycluster_cli.diffusion.parts import ImageRequest, check_scheduler, part_bytes
from raycluster_cli.diffusion.placing import (
    MIB,
    WEIGHT_HEADROOM,
    CutNeeded,
    Holders,
    NodeRoom,
    calibrate,
    image_deadline_s,
    node_rooms,
    place,
)
from raycluster_cli.placement import balance
from raycluster_cli.schema import SCHEMA_VERSION

log = logging.getLogger("raycluster.bench")

PROMPTS = ["a red house on the hill", "a small green tree", "a blue cat", "the dog on the hill", "a red tree"]


def request_for(options: BenchOptions, index: int) -> ImageRequest:
    return ImageRequest(
        PROMPTS[index % len(PROMPTS)], seed=options.seed + index, steps=options.image_steps,
        height=options.image_size, width=options.image_size, guidance=options.guidance_scale,
    )  # fmt: skip


def _deadline_s(options: BenchOptions, seconds: float | None) -> float:
    """``placing.image_deadline_s`` under the bench's own step timeout."""
    return image_deadline_s(options.image_steps, seconds, options.step_timeout_s)


def measure(
    replicas: list[Any],
    seconds: list[float],
    options: BenchOptions,
    total: int,
    policy: str,
    progress: Report,
    label: str,
    keep_first: bool = False,
) -> dict[str, Any]:
    """``total`` images through ``replicas`` by the image service's router (``image_pool``: late binding, under
    ``policy``): wall time, per-image seconds on their lanes, each actor's busy time, what each replica made and
    the seconds per image it ended with; with ``keep_first``, request 0's image (else None) under ``first_image``.
    A replica lost meanwhile is taken out and its images made on the others (``lost``)."""
    import asyncio

    import ray

    from raycluster_cli.diffusion.router import ImagePool, NoReplica, Slot, lanes_of

    slots = [Slot(i, r, s, [], lanes_of(r)) for i, (r, s) in enumerate(zip(replicas, seconds, strict=True))]
    latencies: list[float] = []

    def served(slot: Slot, lane_s: float) -> None:
        latencies.append(lane_s)
        progress(label, len(latencies), total)

    pool = ImagePool(
        slots, max_waiting=total, deadline=lambda s: _deadline_s(options, s), policy=policy, observe=served
    )

    async def everything() -> Any:
        async def one(index: int) -> Any:
            image = await pool.image(request_for(options, index))
            return image if index == 0 and keep_first else None

        made = await asyncio.gather(*(one(i) for i in range(total)))
        return made[0]

    ray.get([a.reset_stats.remote() for r in replicas for a in r.actors], timeout=60)
    progress(label, 0, total)
    started = time.perf_counter()
    try:
        first = asyncio.run(everything())
    except NoReplica as exc:
        raise TimeoutError(f"{exc}: {'; '.join(e['why'] for e in pool.events)}") from None
    wall = time.perf_counter() - started
    alive = [a for s in slots if s.state == "live" for a in s.replica.actors]
    stats = ray.get([a.stats.remote() for a in alive], timeout=60)
    busy = [s["busy_s"] for s in stats]
    return {
        "policy": policy,
        "images": total,
        "wall_s": wall,
        "images_per_s": total / wall if wall > 0 else 0.0,
        "latency_s": balance.latency_summary(latencies),
        "per_replica": [s.served for s in slots],
        "learned_s_per_image": [s.s_per_image for s in slots],
        "nodes": stats,
        "imbalance": balance.imbalance(busy) if len(busy) > 1 else 0.0,
        "t_max_minus_t_min_s": balance.spread(busy) if len(busy) > 1 else 0.0,
        "first_image": first,
        **(
            {"lost": pool.events, "lost_replicas": [s.index for s in slots if s.state != "live"]} if pool.events else {}
        ),
    }


def run(options: BenchOptions, progress: Report) -> dict[str, Any]:
    """One image benchmark: placement, calibration, the counted run, references; the JSON-ready document."""
    import ray

    options = options.effective()
    started = time.perf_counter()
    check_scheduler(str(options.model_path))  # before any actor loads the folder
    if not ray.is_initialized():
        ray.init(address="auto", logging_level=logging.ERROR, log_to_driver=False)
    path = str(options.model_path)
    weights = part_bytes(path)
    rooms = node_rooms()
    ip_of = {n.node_id: n.node_ip for n in rooms}
    output_check: dict[str, Any] | None = None
    replicas, holders, why, cut = _start_replicas(options, path, rooms, weights, progress)
    try:
        infos: list[dict[str, Any]] = ray.get([a.info.remote() for r in replicas for a in r.actors], timeout=600)
        seconds = calibrate(
            replicas, request_for(options, 0), options.calibration_repeats, _deadline_s(options, None), progress
        )
        total = options.requests or max(2 * len(replicas), 8)
        policy = "weighted" if options.partition == "balanced" else "equal"
        main = measure(replicas, seconds, options, total, policy, progress, "counted run", options.check_output)
        first_image = main.pop("first_image")
        references = _references(main, replicas, seconds, holders, ip_of, options, total, policy, progress)
    finally:
        for replica in replicas:
            replica.kill()
    if options.check_output:  # with the replicas gone: a part's reference step takes the room its worker had
        output_check = _check(path, options, first_image, check_nodes(holders, cut, rooms, weights))
    doc: dict[str, Any] = {
        "kind": "image",
        **main,
        "placement": _placement_doc(why, holders, seconds, weights, cut, rooms),
        "workers": infos,
        "references": references,
        "config": {
            "model_path": path,
            "requests": total,
            "steps": options.image_steps,
            "size": options.image_size,
            "guidance_scale": options.guidance_scale,
            "seed": options.seed,
            "routing": policy,
            "calibration_repeats": options.calibration_repeats,
        },
        "total_s": time.perf_counter() - started,
    }
    if output_check is not None:
        doc["output_check"] = output_check
    return {"schema_version": SCHEMA_VERSION, "ok": True, **doc}


def _start_replicas(
    options: BenchOptions, path: str, rooms: list[NodeRoom], weights: dict[str, int], progress: Report
) -> tuple[list[Any], list[Holders], str, dict[str, Any] | None]:
    """The replicas started where ``place`` put them; where no node holds the UNet, one replica cut by blocks."""
    from raycluster_cli.diffusion.workers import Replica

    try:
        holders, why = place(rooms, weights, options.image_size)
        progress(f"placing {len(holders)} replica(s)")
        return [Replica(path, h, options.threads) for h in holders], holders, why, None
    except CutNeeded as exc:
        from raycluster_cli.diffusion import unet_place
        from raycluster_cli.diffusion.unet_workers import CutReplica

        progress("no node holds the UNet: timing its blocks on every node")
        plan, cut, why = unet_place.place_cut(
            path, rooms, request_for(options, 0), exc.needs, WEIGHT_HEADROOM, options.threads
        )
        replica = CutReplica(path, plan.text, plan.stages, plan.vae, options.threads)
        return [replica], [replica.holders], why, cut


def _references(
    main: dict[str, Any],
    replicas: list[Any],
    seconds: list[float],
    holders: list[Holders],
    ip_of: dict[str, str],
    options: BenchOptions,
    total: int,
    policy: str,
    progress: Report,
) -> dict[str, Any]:
    """The same run's references: the ceiling, the other routing, and the fastest replica alone."""
    references: dict[str, Any] = {"ceiling": ceiling(main, replicas)}
    if options.references and len(replicas) > 1:
        other = "equal" if policy == "weighted" else "weighted"
        ref = measure(replicas, seconds, options, total, other, progress, f"reference: {other} routing")
        references[other] = _reference(main, ref)
        fastest = min(range(len(replicas)), key=lambda i: seconds[i])
        one = measure([replicas[fastest]], [seconds[fastest]], options, total, "equal", progress, "reference: one node")
        references["one_node"] = _reference(main, one) | {"node_ip": ip_of[holders[fastest][0][0]]}
    return references


def _placement_doc(
    why: str,
    holders: list[Holders],
    seconds: list[float],
    weights: dict[str, int],
    cut: dict[str, Any] | None,
    rooms: list[NodeRoom],
) -> dict[str, Any]:
    ip_of = {n.node_id: n.node_ip for n in rooms}
    return {
        "why": why,
        "replicas": [
            {"holders": [{"node_ip": ip_of[n], "parts": parts} for n, parts in h], "s_per_image": s}
            for h, s in zip(holders, seconds, strict=True)
        ],
        "weights_mib": {part: round(b / MIB, 2) for part, b in weights.items()},
        **({"unet_cut": cut} if cut is not None else {}),
        "node_memory_mib": {n.node_ip: n.capacity // MIB for n in rooms},
        "node_rooms": [
            {
                "node_ip": n.node_ip,
                "room_mib": n.capacity // MIB,
                "source": n.source,
                "limit_mib": n.limit // MIB if n.limit else None,
                "cpus": n.cpus,
            }
            for n in rooms
        ],
    }


def ceiling(main: dict[str, Any], replicas: list[Any]) -> dict[str, Any]:
    """The pipeline ceiling (as ``planning.ceiling_tokens_per_s`` for text): each replica's images over its
    busiest node's busy time (the parts on one node share its CPU, so a node's parts add up), summed; the run's
    images/s over it.  1.0: the slowest node computed all the time and every hand-over was hidden."""
    per_actor = iter(main["nodes"])  # the replicas that stayed live, in order
    total, busiest_at = 0.0, []
    lost = set(main.get("lost_replicas", []))
    for index, (replica, made) in enumerate(zip(replicas, main["per_replica"], strict=True)):
        if index in lost:
            continue
        by_node: dict[str, float] = {}
        ips: dict[str, str] = {}
        for _ in replica.actors:
            stat = next(per_actor)
            by_node[stat["node_id"]] = by_node.get(stat["node_id"], 0.0) + stat["busy_s"]
            ips[stat["node_id"]] = stat["node_ip"]
        busiest = max(by_node.values())
        busiest_at.append({"busy_s": busiest, "node_ip": ips[max(by_node, key=lambda k: by_node[k])]})
        total += made / busiest if busiest > 0 else 0.0
    return {
        "images_per_s": total,
        "ratio": main["images_per_s"] / total if total else None,
        "busiest": busiest_at,
    }


def _reference(main: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    busy = [n["busy_s"] for n in ref["nodes"]]
    return {
        "images_per_s": ref["images_per_s"],
        "ratio": main["images_per_s"] / ref["images_per_s"] if ref["images_per_s"] else None,
        "wall_s": ref["wall_s"],
        "imbalance": ref["imbalance"],
        "busy_s": busy,
        "per_replica": ref["per_replica"],
    }


# float32 on CPU; nodes with other thread counts reduce in another order: far below one 8-bit level (0.0039)
CHECK_TOLERANCE = 1e-4


def check_nodes(
    holders: list[Holders], cut: dict[str, Any] | None, rooms: list[NodeRoom], weights: dict[str, int]
) -> dict[str, str] | str:
    """Where each part's reference step runs: on the node the first replica holds it on; for a UNet cut by blocks
    (no node's `memory` holds it), the UNet's on the node whose container has the most room, if that holds it.
    Else why the check cannot run, in words."""
    where = {part: node for node, parts in holders[0] for part in parts}
    if cut is None:
        return where
    roomiest = max(rooms, key=lambda n: n.container or 0)
    need = int(weights["unet"] * WEIGHT_HEADROOM)
    if (roomiest.container or 0) < need:
        return (
            f"no node's container holds the UNet for diffusers' own pipeline ({need // MIB} MiB; the most room: "
            f"{roomiest.node_ip} {(roomiest.container or 0) // MIB} MiB)"
        )
    return where | {"unet": roomiest.node_id}


def _check(path: str, options: BenchOptions, image: Any, where: dict[str, str] | str) -> dict[str, Any]:
    """The first request's image against diffusers' own StableDiffusionPipeline, run one part at a time on the
    nodes ``where`` names (``diffusion_workers.reference_image``): no node, the driver's included, needs room for
    the whole pipeline."""
    import numpy as np

    from raycluster_cli.diffusion.workers import reference_image

    if isinstance(where, str):
        return {"identical": None, "skipped": where, "tolerance": CHECK_TOLERANCE}
    theirs = reference_image(path, request_for(options, 0), where, _deadline_s(options, None))
    diff = float(np.abs(np.asarray(image) - theirs).max())
    return {"identical": diff <= CHECK_TOLERANCE, "max_abs_diff": diff, "tolerance": CHECK_TOLERANCE}
