"""Medians of `benchmarks/bench_targets.sh` rounds against issue 12's targets.

Usage: python benchmarks/bench_targets_summary.py DIR   (reads DIR/<config>-<round>.json and the load files)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

# config -> (least balanced/even, most imbalance, least share of the pipeline ceiling); None: no target
TARGETS: dict[str, tuple[float, float | None, float | None]] = {
    "unequal": (1.5, 0.10, 0.9),
    "equal": (1.0, 0.05, None),
    "demo": (1.5, None, None),
}


def _doc(path: Path) -> dict[str, Any] | None:
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if doc.get("ok") else None


def balanced_over_even(doc: dict[str, Any]) -> float | None:
    """The balanced split's tokens/s over the even split's, as measured in the run: from the even reference when
    the balanced split ran, from the balanced reference when the run fell back to the even split (its ratio is
    even ÷ balanced), 1.0 only when the two splits are the same split; None when nothing compared them."""
    refs = doc.get("references", {})
    choice = doc.get("split_choice", {})
    if choice.get("used") == "even":
        ratio = refs.get("balanced", {}).get("ratio")
        return 1.0 / ratio if ratio else None
    if "even" in refs:
        ratio = refs["even"]["ratio"]
        return float(ratio) if ratio is not None else None
    if choice.get("reason") == "the balanced split is the even split":
        return 1.0
    return None


def _load(path: Path) -> str:
    return path.read_text().strip() if path.exists() else "?"


def _med(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def summarise(directory: Path, name: str) -> None:
    rounds = sorted(directory.glob(f"{name}-*.json"), key=lambda p: int(p.stem.split("-")[-1]))
    docs = [(p, _doc(p)) for p in rounds]
    good = [d for _, d in docs if d]
    print(f"{name}: {len(good)}/{len(docs)} rounds succeeded")
    for path, doc in docs:
        base = path.with_suffix("")
        load = f"load {_load(base.with_name(base.name + '.load-before'))} -> {_load(base.with_name(base.name + '.load-after'))}"
        if not doc:
            print(f"  {path.stem}: failed ({load})")
            continue
        refs = doc["references"]
        print(
            f"  {path.stem} ({load}): layers {doc['config']['model']['layers']}, requests {doc['requests']}, "
            f"split {[s['layers'] for s in doc['stages']]} ({doc['split_choice']['used']}), "
            f"{doc['tokens_per_s']:.1f} tok/s ±{50 * (doc.get('tokens_per_s_spread') or 0):.0f}%, "
            f"x even {_fmt(balanced_over_even(doc))}, imbalance {doc['imbalance']:.3f} "
            f"(quotas {doc['imbalance_capacity']:.3f}), x ceiling {_fmt(refs['ceiling']['ratio'])}, "
            f"x unsharded {_fmt(refs.get('unsharded', {}).get('ratio'))}, hop {1000 * doc['hop_overhead']['per_hop_s']:.2f} ms, "
            f"whole bench {_fmt(doc.get('total_s'), 0)} s"
        )
    if not good:
        return
    ratio = _med([balanced_over_even(d) for d in good])
    imbalance = _med([d["imbalance"] for d in good])
    ceiling = _med([d["references"]["ceiling"]["ratio"] for d in good])
    unsharded = _med([d["references"].get("unsharded", {}).get("ratio") for d in good])
    print(
        f"  medians: x even {_fmt(ratio)}, imbalance {_fmt(imbalance, 3)}, x ceiling {_fmt(ceiling)}, "
        f"x unsharded {_fmt(unsharded)}"
    )
    least_ratio, most_imbalance, least_ceiling = TARGETS[name]
    verdicts = [f"x even >= {least_ratio}: {'met' if ratio is not None and ratio >= least_ratio else 'NOT met'}"]
    if most_imbalance is not None:
        verdicts.append(
            f"imbalance <= {most_imbalance}: {'met' if imbalance is not None and imbalance <= most_imbalance else 'NOT met'}"
        )
    if least_ceiling is not None:
        verdicts.append(
            f"x ceiling >= {least_ceiling}: {'met' if ceiling is not None and ceiling >= least_ceiling else 'NOT met'}"
        )
    print("  targets: " + "; ".join(verdicts))


def main(directory: str) -> None:
    for name in TARGETS:
        summarise(Path(directory), name)


if __name__ == "__main__":
    main(sys.argv[1])
