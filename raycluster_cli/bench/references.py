"""The counted run's references (the scheduling ceiling, the other split and the whole model unsharded on the
fastest node whose memory holds it; a reference that fits nowhere is skipped with the reason) and its config."""

from __future__ import annotations

from typing import Any

from raycluster_cli.bench import experiment, planning
from raycluster_cli.placement import memory

Ranges = list[list[tuple[int, int]]]


def references(session: Any, result: Any, ranges: Ranges, choice: dict[str, Any]) -> dict[str, Any]:
    """The ceiling, the other split (or why it was skipped) and the unsharded model (or why it was skipped)."""
    alive = [result.replicas[i] for i in range(len(result.replicas)) if not result.replicas[i].lost]
    busiest = [r.busiest_s for r in alive]
    ceiling = planning.ceiling_tokens_per_s([r.tokens for r in alive], busiest)
    stages = [s for s in result.stage_dicts()]
    bottleneck = max(stages, key=lambda s: s["busy_s"]) if stages else {"busy_s": 0.0}
    refs: dict[str, Any] = {
        "ceiling": {
            "tokens_per_s": ceiling,
            "ratio": result.tokens_per_s / ceiling if ceiling else None,
            "gap": planning.ceiling_gap(result.wall_s, bottleneck),
        }
    }
    if not session.options.references:
        return refs
    other = "balanced" if choice.get("used") == "even" and session.balanced_ranges else "even"
    try:
        other_ranges = session.balanced_ranges if other == "balanced" else session.ranges_for("even")
    except memory.ModelTooLarge as exc:
        refs[other], other_ranges = {"skipped": str(exc)}, None
    if other_ranges is not None and other_ranges != ranges:
        run = session.measure(other_ranges, session.params, f"reference: {other} split")
        refs[other] = experiment.reference(result, run, {"partition_ranges": [list(r) for r in other_ranges[0]]})
    candidates = [n for r in session.alive() for n in session.node_ids[r * session.num_stages :][: session.num_stages]]
    whole = [(0, session.cfg.num_units)]
    fitting_nodes = [n for n in candidates if session.memory is None or not session.memory.why_not(whole, [n])]
    plan = session.memory
    if candidates and not fitting_nodes and plan is not None:
        roomiest = max(candidates, key=lambda n: plan.stage_room([n])[0])
        why = plan.why_not(whole, [roomiest])
        refs["unsharded"] = {"skipped": f"the whole model fits no node's memory: {why}"}
    candidates = fitting_nodes
    if candidates:
        fastest = min(candidates, key=lambda nid: sum(session.costs[nid]))
        worker = session.workers[session.node_ids.index(fastest)]
        run = session.measure([whole], session.params, "reference: unsharded", replicas=[[worker]])
        refs["unsharded"] = experiment.reference(result, run, {"node_ip": session.node_ip(fastest)})
    return refs


def config_doc(session: Any, first_ranges: list[list[int]]) -> dict[str, Any]:
    """The run's configuration as the report's ``config`` shows it."""
    o, p = session.options, session.params
    return {
        "model": session.cfg.to_dict(),
        "model_source": f"{session.cfg.family or session.cfg.arch}:{session.cfg.model_path}"
        if session.cfg.model_path
        else "random",
        "dtype": session.cfg.dtype,
        "dtype_choice": session.dtype_choice,
        "layers_auto": not (o.layers or o.model_path or o.manual_counts),
        "mode": o.load_mode,
        "rate": o.rate,
        "requests": p.requests,
        "requests_auto": o.requests is None,
        "duration_s": o.duration_s,
        "prompt_len": o.prompt_len,
        "max_new_tokens": o.max_new_tokens,
        "micro_batch": o.micro_batch,
        "prefill_chunk": o.prefill_chunk,
        "seed": o.seed,
        "stages": session.num_stages,
        "replicas": len(session.replicas),
        "partition": o.partition,
        "partition_ranges": first_ranges,
        "threads": o.threads,
        "allow_shared_nodes": o.allow_shared_nodes,
        "alive_nodes": len(session.nodes),
        "calibration_repeats": o.calibration_repeats,
        "calibration_sample_s": o.calibration_sample_s,
        "refine": o.refine if o.partition == "balanced" else 0,
        "quick": o.quick,
        "step_timeout_s": o.step_timeout_s,
        "latency_origin": "request_arrival",
        "warmup": "one micro-batch per replica, not counted",
    }
