"""Summaries for fleet.sh.

`times N FILE`: FILE has lines "WHAT SECONDS LOAD"; prints each verb's median and its ratio to the floor's
(with BASELINE, "VERB@base" too: the other checkout's, measured in the same rounds).
`commands VERB BEFORE AFTER`: per-host session counts before and after one run of VERB; prints min/max.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path


def times(n: str, path: str) -> None:
    seen: dict[str, list[float]] = defaultdict(list)
    loads: list[float] = []
    for line in Path(path).read_text().splitlines():
        what, seconds, load = line.split()
        seen[what].append(float(seconds))
        loads.append(float(load))
    floor = statistics.median(seen["floor"])
    parts = [f"floor {floor:.2f}s"]
    for what in [name for verb in ("doctor", "status", "down") for name in (verb, f"{verb}@base") if name in seen]:
        median = statistics.median(seen[what])
        parts.append(f"{what} {median:.2f}s ({median / floor:.2f}x)")
    rounds = len(seen["floor"])
    print(f"{n:>3} hosts: " + ", ".join(parts) + f"; {rounds} rounds, load {min(loads):.1f}-{max(loads):.1f}")


def commands(verb: str, before: str, after: str) -> None:
    counts = [int(b) - int(a) for a, b in zip(before.split(), after.split(), strict=True)]
    print(f"{verb}: {min(counts)}-{max(counts)} remote commands per host over {len(counts)} hosts")


if __name__ == "__main__":
    {"times": times, "commands": commands}[sys.argv[1]](*sys.argv[2:])
