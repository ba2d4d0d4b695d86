"""What one serving step costs on a CPU stage holding a whole model, by the step's shape: decode rows alone, decode
rows beside prompt chunks (a mixed step, as chunked prefill makes them), and prompt chunks alone (issue 49: the
prefill's throughput in service).

Usage:  PYTHONPATH=TREE python benchmarks/step_shapes.py CHECKPOINT_DIR [--decodes 12] [--chunks 64,64,64,20]
            [--prompt 128] [--repeats 9] [--threads 1] [--dtype bfloat16] [--out FILE]

The checkpoint (``benchmarks/real_shapes.py`` writes random ones at real shapes) is loaded as one ``BatchedStage``
of the tree on PYTHONPATH (to compare two trees, run it with each, alternated).  ``--decodes`` sequences are
prefilled with ``--prompt`` tokens; then each kind of step runs ``--repeats`` times (the decodes move one position a
step; the chunks start fresh sequences in their own slots), each step's process CPU time taken (CPU time, not wall:
the figure holds on a machine doing other work; the wall time beside it).  Prints one JSON document: each kind's
median and spread in ms, its real tokens, and the CPU ms per real token.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _report import emit  # benchmarks/_report.py, beside this script

from raycluster_cli.models.batched import BatchedStage
from raycluster_cli.models.decoder import config_from_checkpoint


def _step(decodes: int, chunks: list[int], position: int) -> tuple[list[int], list[tuple[int, int, int]]]:
    """The rows of one step: (lengths, (slot, start, length) each): decode rows first, then the chunks' rows."""
    rows = [(slot, position, 1) for slot in range(decodes)]
    rows += [(decodes + i, 0, n) for i, n in enumerate(chunks)]
    return [n for _, _, n in rows], rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--decodes", type=int, default=12)
    p.add_argument("--chunks", default="64,64,64,20")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    chunks = [int(n) for n in args.chunks.split(",") if n]
    kinds = {"decode": (args.decodes, []), "mixed": (args.decodes, chunks), "prefill": (0, chunks)}
    steps = 2 * args.repeats + 2
    cfg = config_from_checkpoint(args.checkpoint, max_seq=args.prompt + steps + max(chunks) + 1, dtype=args.dtype)
    stage = BatchedStage(cfg, 0, cfg.num_units, args.decodes + len(chunks))
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    walls: dict[str, list[float]] = {kind: [] for kind in kinds}
    with torch.inference_mode():
        for row in range(args.decodes):
            ids = torch.randint(0, cfg.vocab, (1, args.prompt), generator=gen)
            stage.forward(ids, torch.tensor([[row], [0], [args.prompt]]))
        position = args.prompt
        for repeat in range(args.repeats + 1):
            for kind, (decodes, pieces) in kinds.items():
                lengths, rows = _step(decodes, pieces, position)
                ids = torch.randint(0, cfg.vocab, (len(rows), max(lengths)), generator=gen)
                table = torch.tensor(rows, dtype=torch.long).T.contiguous()
                began, wall = time.process_time(), time.perf_counter()
                stage.forward(ids, table)
                spent, wall = time.process_time() - began, time.perf_counter() - wall
                position += decodes > 0
                if repeat:  # the first round warms up
                    times[kind].append(spent)
                    walls[kind].append(wall)
    report: dict[str, Any] = {
        "checkpoint": str(args.checkpoint),
        "layers": cfg.layers,
        "d_model": cfg.d_model,
        "vocab": cfg.vocab,
        "dtype": args.dtype,
        "threads": args.threads,
        # the products' forms the stage measured as it loaded (models.matmuls), which a step's cost depends on
        "matmuls": {"blocks": stage.block_mm.describe(), "head": stage.head_mm.describe()},
        "steps": {},
    }
    for kind, (decodes, pieces) in kinds.items():
        spent = sorted(times[kind])
        tokens = decodes + sum(pieces)
        median = statistics.median(spent)
        report["steps"][kind] = {
            "rows": decodes + len(pieces),
            "tokens": tokens,
            "cpu_ms_p50": round(median * 1000, 1),
            "cpu_ms_min_max": [round(spent[0] * 1000, 1), round(spent[-1] * 1000, 1)],
            "cpu_ms_per_token": round(median * 1000 / tokens, 3),
            # wall: what a CPU quota (a container's --cpus) adds while the process waits for its share
            "wall_ms_p50": round(statistics.median(walls[kind]) * 1000, 1),
        }
    emit(report, args.out)


if __name__ == "__main__":
    main()
