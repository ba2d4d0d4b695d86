"""Pilot runs: correct the calibration with measured stage times, and never use a split worse than even.

``refine`` runs the counted workload (shortened) on the calibrated split and corrects each node's
costs with what it measured; ``pick_split`` then runs the even split as a pilot too and keeps
whichever of the two measured faster.  Pure Python apart from the run function it is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

Ranges = list[list[tuple[int, int]]]


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def pilot_factors(calibrated: dict[str, list[float]], pilot: Any) -> dict[str, float]:
    """Each node's measured / predicted time of its stages in a pilot run, against the calibration.

    Calibration times each node alone; in the pipeline a node also runs Ray's own processes (the
    head: the driver and the GCS) and competes with its neighbours for the physical cores.  The
    pilot's times include all that.  The measured time is the stage's capacity time
    (``metrics.capacity_time``: busy time, or CPU time / CPU quota when larger), so a stage that
    waits for work and computes in unthrottled bursts under its quota is not mistaken for a fast node.
    """
    from raycluster_cli.bench.planning import predicted_busy

    per_node: dict[str, list[float]] = {}
    batches = {r.index: r.micro_batches for r in pilot.replicas}
    for stage in pilot.stages:
        predicted = predicted_busy(calibrated[stage.node_id], stage.units[0], stage.units[1], batches[stage.replica])
        if predicted > 0 and stage.capacity_s > 0:
            per_node.setdefault(stage.node_id, []).append(stage.capacity_s / predicted)
    return {nid: geomean(values) for nid, values in per_node.items()}


def _entry(ranges: Ranges, pilot: Any) -> dict[str, Any]:
    summary = pilot.summary()
    return {
        "ranges": ranges,
        "partition_ranges": [list(r) for r in ranges[0]],
        "tokens_per_s": summary["tokens_per_s"],
        "imbalance": summary["imbalance"],
        "imbalance_capacity": summary.get("imbalance_capacity"),
        "busy_s": [s.busy_s for s in pilot.stages],
        "capacity_s": [s.capacity_s for s in pilot.stages],
    }


def refine(
    ranges: Ranges,
    pilots: int,
    run_pilot: Callable[[Ranges, int], Any],
    costs: dict[str, list[float]],
    solve: Callable[[], Ranges],
) -> tuple[Ranges, list[dict[str, Any]]]:
    """Pilot runs that correct the calibration; returns the split to use and what each pilot saw.

    Each pilot runs the current split and measures, for every node, how its stage's time compares
    with what the calibration predicted (``pilot_factors``).  The node's costs become the
    calibration times the geometric mean of its factors over *all* pilots so far, and the split is
    solved again.  Averaging is what makes this converge on a noisy machine: on the 2-core lab one
    run measures a node ±10 % off the next, and a correction from the last pilot alone chased that
    noise from split to split.  It stops early when the last two pilots measured the same split and
    the averaged costs still give it back.  ``costs`` is updated in place.
    """
    calibrated = {nid: list(row) for nid, row in costs.items()}
    history: dict[str, list[float]] = {}
    tried: list[dict[str, Any]] = []
    for index in range(pilots):
        pilot = run_pilot(ranges, index)
        factors = pilot_factors(calibrated, pilot)
        for nid, factor in factors.items():
            history.setdefault(nid, []).append(factor)
        for nid, values in history.items():
            costs[nid] = [c * geomean(values) for c in calibrated[nid]]
        entry = _entry(ranges, pilot)
        entry["factors"] = factors
        entry["mean_factors"] = {nid: geomean(values) for nid, values in history.items()}
        tried.append(entry)
        ranges = solve()
        if len(tried) >= 2 and ranges == tried[-1]["ranges"] == tried[-2]["ranges"]:
            break  # measured twice and still the answer: more pilots would only repeat it
    return ranges, tried


def pick_split(
    chosen: Ranges, even: Ranges, tried: list[dict[str, Any]], run_even: Callable[[], Any]
) -> tuple[Ranges, dict[str, Any]]:
    """The balanced split, unless the even split measured at least as fast in a pilot of its own.

    The balanced figure is the chosen split's own pilot when it was measured (the last one), else
    the best pilot.  Returns the split to use and a record of the comparison.
    """
    if not tried:
        return chosen, {"used": "balanced", "reason": "no pilots"}
    if chosen == even:
        return chosen, {"used": "balanced", "reason": "the balanced split is the even split"}
    own = [t for t in tried if t["ranges"] == chosen]
    balanced_tps = own[-1]["tokens_per_s"] if own else max(t["tokens_per_s"] for t in tried)
    even_pilot = run_even()
    even_tps = even_pilot.summary()["tokens_per_s"]
    record = {
        "balanced_pilot_tokens_per_s": balanced_tps,
        "even_pilot_tokens_per_s": even_tps,
        "even_pilot": {k: v for k, v in _entry(even, even_pilot).items() if k != "ranges"},
    }
    if even_tps >= balanced_tps:
        reason = f"the even split measured {even_tps:.1f} tok/s in its pilot, the balanced {balanced_tps:.1f}"
        return even, {"used": "even", "reason": reason, **record}
    return chosen, {"used": "balanced", "reason": "faster than the even split in the pilots", **record}


def public(tried: list[dict[str, Any]], chosen: Ranges, node_ip: dict[str, str]) -> list[dict[str, Any]]:
    """The pilots as JSON: node ids become IPs, the split used is marked."""
    out = []
    for entry in tried:
        item = {k: v for k, v in entry.items() if k != "ranges"}
        item["chosen"] = entry["ranges"] == chosen
        for key in ("factors", "mean_factors"):
            item[key] = {node_ip.get(nid, nid): f for nid, f in entry.get(key, {}).items()}
        out.append(item)
    return out
