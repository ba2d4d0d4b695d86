"""The table of engine_vs_vllm.sh: output tokens/s per service and mode (median, min-max over rounds) and the
issue-49 ratios, each taken round by round (the services of one round ran back to back on the same machine):

- E1: raycluster on the 1.0-CPU host alone / vLLM on one CPU, saturation, greedy and sampled;
- E2: raycluster on the 3 unequal hosts / vLLM on one CPU, and / raycluster on the 1.0 host alone;
- E3: sampled / greedy throughput of each service;
- E6: one request at a time, p50 TPOT of raycluster / vLLM's.

``python benchmarks/engine_vs_vllm_summary.py OUT`` reads OUT/runs/SERVICE-MODE-rN.json (bench --serve documents),
prints the table and writes OUT/summary.json. A service or run that is missing is left out of its ratios.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

SERVICES = {"vllm": "vLLM CPU, 1 CPU", "one": "raycluster, 1.0 host", "three": "raycluster, 3 hosts"}
MODES = ("greedy", "sampled", "single")
RATIOS = {  # name -> (numerator service, denominator service, mode, figure)
    "E1 greedy: one host / vLLM": ("one", "vllm", "greedy", "tokens"),
    "E1 sampled: one host / vLLM": ("one", "vllm", "sampled", "tokens"),
    "E2 greedy: three hosts / vLLM": ("three", "vllm", "greedy", "tokens"),
    "E2 sampled: three hosts / vLLM": ("three", "vllm", "sampled", "tokens"),
    "E2 greedy: three hosts / one host": ("three", "one", "greedy", "tokens"),
    "E6 one at a time, TPOT p50: one host / vLLM": ("one", "vllm", "single", "tpot"),
    "E6 one at a time, TPOT p50: three hosts / vLLM": ("three", "vllm", "single", "tpot"),
}


def figures(run: dict[str, Any]) -> dict[str, float]:
    return {
        "tokens": float(run["output_tokens_per_s"]),
        "tpot": float(run["latency_s"]["tpot"]["p50"]),
        "ttft": float(run["latency_s"]["ttft"]["p50"]),
    }


def load(out: Path) -> dict[tuple[str, str], dict[int, dict[str, float]]]:
    """(service, mode) -> round -> that run's figures; runs with failed requests are left out (and counted)."""
    found: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    for path in sorted((out / "runs").glob("*-r*.json")):
        match = re.fullmatch(r"(vllm|one|three)-(greedy|sampled|single)-r(\d+)", path.stem)
        if not match:
            continue
        try:
            (run,) = json.loads(path.read_text())["runs"]
        except (ValueError, KeyError) as exc:
            print(f"{path.name}: no run ({exc})", file=sys.stderr)
            continue
        if run.get("failed"):
            print(f"{path.name}: {run['failed']} failed requests; left out", file=sys.stderr)
            continue
        found.setdefault((match[1], match[2]), {})[int(match[3])] = figures(run)
    return found


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(found: dict[tuple[str, str], dict[int, dict[str, float]]]) -> dict[str, Any]:
    table = {
        f"{service} {mode}": {k: spread([r[k] for r in rounds.values()]) for k in ("tokens", "tpot", "ttft")}
        for (service, mode), rounds in sorted(found.items())
    }
    ratios: dict[str, Any] = {}
    for name, (top, bottom, mode, key) in RATIOS.items():
        a, b = found.get((top, mode), {}), found.get((bottom, mode), {})
        ratios[name] = spread([a[n][key] / b[n][key] for n in sorted(set(a) & set(b)) if b[n][key]])
    for service in SERVICES:
        greedy, sampled = found.get((service, "greedy"), {}), found.get((service, "sampled"), {})
        pairs = [sampled[n]["tokens"] / greedy[n]["tokens"] for n in sorted(set(greedy) & set(sampled))]
        ratios[f"E3 sampled / greedy: {service}"] = spread(pairs)
    return {"runs": table, "ratios": ratios}


def _cell(s: dict[str, float] | None, scale: float = 1.0, digits: int = 1) -> str:
    if s is None:
        return "—"
    return f"{s['median'] * scale:.{digits}f} ({s['min'] * scale:.{digits}f}–{s['max'] * scale:.{digits}f})"


def render(summary: dict[str, Any]) -> str:
    lines = ["| service | mode | output tok/s | TPOT p50 ms | TTFT p50 ms | rounds |", "|---|---|---|---|---|---|"]
    for key, row in summary["runs"].items():
        service, mode = key.split()
        n = row["tokens"]["n"] if row["tokens"] else 0
        lines.append(
            f"| {SERVICES[service]} | {mode} | {_cell(row['tokens'])} | {_cell(row['tpot'], 1000)} | "
            f"{_cell(row['ttft'], 1000, 0)} | {n} |"
        )
    lines += ["", "| ratio (per round) | median (min–max) |", "|---|---|"]
    lines += [f"| {name} | {_cell(value, digits=2)} |" for name, value in summary["ratios"].items() if value]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python benchmarks/engine_vs_vllm_summary.py OUT", file=sys.stderr)
        return 2
    out = Path(argv[0])
    summary = summarize(load(out))
    setup = out / "setup.txt"
    summary["setup"] = setup.read_text().strip() if setup.exists() else ""
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(summary["setup"])
    print(render(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
