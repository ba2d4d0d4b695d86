"""Medians of repeated `raycluster bench --json` results (written by bench_quota.sh).

Usage: python benchmarks/bench_summary.py DIR LABEL   (reads DIR/round-*.json)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _flat(ranges: list[Any]) -> list[list[int]]:
    """Ranges of replica 0 (older results nest them one level deeper)."""
    return ranges[0] if ranges and isinstance(ranges[0][0], list) else ranges


def _load(path: Path) -> str:
    return path.read_text().strip() if path.exists() else "?"


def _ok(path: Path) -> bool:
    """A finished, successful round (a round still running has an empty file)."""
    try:
        return bool(json.loads(path.read_text()).get("ok"))
    except ValueError:
        return False


def _fmt(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def main(directory: str, label: str) -> None:
    paths = [p for p in sorted(Path(directory).glob("round-*.json")) if _ok(p)]
    docs = [json.loads(p.read_text()) for p in paths]
    if not docs:
        sys.exit(f"no successful results in {directory}")

    def med(f: Any) -> float:
        return statistics.median(f(d) for d in docs)

    def ref(name: str, key: str) -> Any:
        return lambda d: d["references"][name][key]

    even_layers = [
        b - a - (1 if a == 0 else 0) - (1 if i == 2 else 0)
        for i, (a, b) in enumerate(_flat(docs[0]["references"]["even"]["partition_ranges"]))
    ]
    print(f"{label}: {len(docs)} rounds, medians")
    print(f"  balanced layers per round: {[[s['layers'] for s in d['stages']] for d in docs]}; even: {even_layers}")
    print(
        f"  balanced: {med(lambda d: d['tokens_per_s']):.1f} tok/s, imbalance {med(lambda d: d['imbalance']):.3f}, "
        f"against quotas {med(lambda d: d.get('imbalance_capacity', d['imbalance'])):.3f}, "
        f"T_max-T_min {med(lambda d: d['t_max_minus_t_min_s']):.3f} s, utilisation {med(lambda d: d['utilisation']):.2f}"
    )
    print(
        f"  even:     {med(ref('even', 'tokens_per_s')):.1f} tok/s, imbalance {med(ref('even', 'imbalance')):.3f}, "
        f"against quotas {med(lambda d: d['references']['even'].get('imbalance_capacity', 0.0)):.3f}"
    )
    print(
        f"  unsharded ({docs[0]['references']['unsharded'].get('host', '?')}): {med(ref('unsharded', 'tokens_per_s')):.1f} tok/s"
    )
    print(f"  ceiling:  {med(ref('ceiling', 'tokens_per_s')):.1f} tok/s")
    print(
        f"  ratios: balanced/even {med(ref('even', 'ratio')):.2f}x, balanced/unsharded {med(ref('unsharded', 'ratio')):.2f}x, "
        f"balanced/ceiling {med(ref('ceiling', 'ratio')):.2f}x"
    )
    print(f"  per-hop overhead (no-op stages): {1000 * med(lambda d: d['hop_overhead']['per_hop_s']):.2f} ms")
    for path, d in zip(paths, docs, strict=True):
        n = path.stem.split("-")[-1]
        load = [_load(path.with_name(f"load-{n}.{when}")) for when in ("before", "after")]
        stages = ", ".join(
            f"{s['host']} {s['layers']}L {s['num_threads']}t T={s['busy_s']:.2f}s cpu={s.get('cpu_s', 0):.2f}s "
            f"cap={s.get('capacity_s', s['busy_s']):.2f}s "
            f"process-cpu={s.get('process_cpu_s', 0):.2f}s span={s.get('span_s', 0):.2f}s "
            f"pred={s['predicted_s']:.2f}s"
            for s in d["stages"]
        )
        print(
            f"  round {n} (load {load[0]} -> {load[1]}): {stages}; wall {d['wall_s']:.2f}s, "
            f"driver-cpu {d.get('driver_cpu_s', 0):.2f}s, {d['tokens_per_s']:.1f} tok/s, "
            f"imbalance {d['imbalance']:.3f} (quotas {d.get('imbalance_capacity', d['imbalance']):.3f}), x even {d['references']['even']['ratio']:.2f}, "
            f"x ceiling {d['references']['ceiling']['ratio']:.2f}, x unsharded {d['references']['unsharded']['ratio']:.2f}"
        )
        print(
            f"    even: busy {_fmt(d['references']['even']['busy_s'])}, imbalance {d['references']['even']['imbalance']:.3f}"
        )
        for k, p in enumerate(d["calibration"].get("refinements", []), 1):
            layers = [b - a for a, b in p["partition_ranges"]]
            print(
                f"    pilot {k}: units {layers}, {p.get('tokens_per_s', 0):.1f} tok/s, imbalance {p['imbalance']:.3f}"
                f" (quotas {p.get('imbalance_capacity') or p['imbalance']:.3f})"
                f"{', chosen' if p.get('chosen') else ''}; factors {_fmt(list(p['factors'].values()))}"
                f"{'; mean ' + _fmt(list(p['mean_factors'].values())) if 'mean_factors' in p else ''}"
            )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else sys.argv[1])
