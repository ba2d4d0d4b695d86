"""What sampling a step's rows costs: the per-row path the engine ran on its loop (``adjust`` then a per-request
generator's draw, one row at a time) against ``models.sampling.sample_rows`` (all rows at once), at a real
vocabulary, and the bytes a step ships back from the last stage either way.

Usage:  PYTHONPATH=. python benchmarks/sampling_rows.py [--vocab 151936] [--rows 16] [--repeats 15] [--threads 1]
            [--out FILE]

Two logit shapes: "peaked" (Zipf-like, the mass of a real next-token distribution in a few hundred tokens: top-p
0.95 at T 0.8 keeps ~250) and "flat" (standard normal: the nucleus holds most of the vocabulary, so top-p needs
the full sort either way).  For each shape and each setting (greedy; T 0.8 with top-p 0.95) the median ms of a
step's rows with the spread (min, max) over ``--repeats`` runs.  Prints one JSON document (also to --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from raycluster_cli.models.sampling import TABLE_ROWS, Params, RowSampling, sample_rows
from raycluster_cli.node.links import HEADER_BYTES
from raycluster_cli.serve.text import Sampling, adjust, bad_logits


def per_row_sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The engine's per-row draw as it was before ``sample_rows`` (kept here as the baseline): argmax, or a
    multinomial among the tokens min-p, top-k and top-p keep, with a full sort for top-p."""
    if sampling.temperature == 0 or generator is None:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.min_p > 0.0:
        probs = torch.where(probs < sampling.min_p * probs.max(), 0.0, probs)
    if 0 < sampling.top_k < probs.numel():
        kth = probs.topk(sampling.top_k).values[-1]
        probs = torch.where(probs < kth, 0.0, probs)
    if sampling.top_p < 1.0:
        if sampling.min_p > 0.0 or sampling.top_k > 0:
            probs = probs / probs.sum()
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs
        sorted_probs[before >= sampling.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def logits_of(shape: str, rows: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if shape == "flat":
        return torch.randn(rows, vocab, generator=gen)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    zipf = -1.2 * ranks.log()  # p(rank) ~ rank^-1.2
    return torch.stack([zipf[torch.randperm(vocab, generator=gen)] for _ in range(rows)])


def timed(step: Callable[[], object], repeats: int) -> dict[str, float]:
    step()  # the libraries' set-up for the shapes
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        step()
        samples.append((time.perf_counter() - began) * 1e3)
    return {"median_ms": round(statistics.median(samples), 2), "min_ms": round(min(samples), 2),
            "max_ms": round(max(samples), 2)}  # fmt: skip


def case(logits: torch.Tensor, temperature: float, top_p: float, repeats: int) -> dict[str, Any]:
    rows = logits.shape[0]
    sampling = Sampling(temperature=temperature, top_p=top_p)
    generators = [torch.Generator().manual_seed(i) if temperature else None for i in range(rows)]

    def old() -> list[int]:  # as the engine's ``_read_row`` did: the row's check, its processors, its draw
        return [bad_logits(logits[r]) or per_row_sample(adjust(logits[r], sampling, [], [], frozenset()), sampling,
                generators[r]) for r in range(rows)]  # fmt: skip

    params = Params.of([RowSampling(temperature, top_p, seed=i, position=100, mode=1) for i in range(rows)])
    return {"per_row": timed(old, repeats), "sample_rows": timed(lambda: sample_rows(logits, params), repeats)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    table = TABLE_ROWS * args.rows * 8
    report: dict[str, Any] = {
        "vocab": args.vocab, "rows": args.rows, "threads": args.threads, "repeats": args.repeats,
        "torch": torch.__version__,
        "step_back_bytes": {  # the last stage's message to the engine: header, table, payload
            "logits_float32": HEADER_BYTES + table + args.rows * args.vocab * 4,
            "ids_int64": HEADER_BYTES + table + args.rows * 8,
        },
        "cases": {},
    }  # fmt: skip
    for shape in ("peaked", "flat"):
        logits = logits_of(shape, args.rows, args.vocab)
        for name, temperature, top_p in (("greedy", 0.0, 1.0), ("T0.8_top_p0.95", 0.8, 0.95)):
            report["cases"][f"{shape}/{name}"] = case(logits, temperature, top_p, args.repeats)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
