"""`bench` with its stages on CUDA: a local single-node Ray on a GPU machine, the pipeline's stages stacked on
its one GPU (each stage asks Ray for an equal share of it), the report as `raycluster bench --json` gives it.

    PYTHONPATH=. python benchmarks/gpu_local.py OUT_DIR [small] [batches]

Runs, each saved as OUT_DIR/gpu-bench-NAME.json with a one-line summary on stdout:
- `float32`: a random Llama (d_model 2048, 16 heads, 24 blocks, ~1.3 B parameters), 3 stages, balanced split
  next to the even split and the whole model unsharded on the same GPU, greedy output checked against the
  unsharded model;
- `bfloat16`: the same in bfloat16 (weights, KV cache, activations), output checked the same way.
`batches` runs instead: bfloat16 with its output checked (teacher-forced, top-5 tolerance), then bfloat16 and
float32 with four times the micro-batch and the requests (no output check).
`small` shrinks the model for a try on a CPU machine (no GPU: the stages run on the CPU). A run that fails is
saved with its error and the others still run.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private throwaway cluster on this machine

import ray
import torch

from raycluster_cli.bench import session
from raycluster_cli.bench.options import BenchOptions

BIG = {"d_model": 2048, "heads": 16, "layers": 24, "vocab": 32000, "prompt_len": 128, "max_new_tokens": 64}
SMALL = {"d_model": 64, "heads": 4, "layers": 6, "vocab": 256, "prompt_len": 8, "max_new_tokens": 4}


def summary(name: str, doc: dict[str, Any], wall: float) -> str:
    if not doc.get("ok", True) or "error" in doc:
        return f"{name}: FAILED in {wall:.0f}s: {str(doc.get('error'))[:300]}"
    refs = doc.get("references", {})
    stages = ", ".join(
        f"{s.get('device')} {s.get('layers')} blocks busy {s.get('busy_s', 0):.3f}s" for s in doc.get("stages", [])
    )
    return (
        f"{name}: {wall:.0f}s wall; {doc.get('tokens_per_s', 0):.1f} tok/s; split {doc.get('split_choice')}; "
        f"imbalance {doc.get('imbalance')}; stages [{stages}]; "
        f"even x{refs.get('even', {}).get('ratio')}, unsharded x{refs.get('unsharded', {}).get('ratio')}; "
        f"hop {doc.get('hop_overhead', {}).get('per_hop_s')}; output {doc.get('output_check')}"
    )


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    model = SMALL if "small" in sys.argv[2:] else BIG
    on_gpu = torch.cuda.is_available()
    print(f"torch {torch.__version__}, cuda {on_gpu}, {torch.cuda.get_device_name(0) if on_gpu else 'no GPU'}")
    ray.init(include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    print("ray resources", ray.cluster_resources(), flush=True)
    base: dict[str, Any] = {
        **model,
        "allow_shared_nodes": True,
        "stages": 3,
        "requests": 96 if model is BIG else 12,
        "micro_batch": 16 if model is BIG else 3,
        "refine": 1,
        "calibration_repeats": 3,
        "calibration_sample_s": 0.05,
        "check_output": True,
        "check_requests": 8,
    }
    runs: tuple[tuple[str, dict[str, Any]], ...] = (
        ("float32", {"dtype": "float32"}),
        ("bfloat16", {"dtype": "bfloat16"}),
    )
    if "batches" in sys.argv[2:]:  # the bfloat16 check's tolerance, then four times the micro-batch
        big = {"micro_batch": base["micro_batch"] * 4, "requests": base["requests"] * 4, "check_output": False}
        runs = (
            ("bfloat16-check", {"dtype": "bfloat16"}),
            ("bfloat16-mb4x", {"dtype": "bfloat16", **big}),
            ("float32-mb4x", {"dtype": "float32", **big}),
        )
    for name, fields in runs:
        started = time.monotonic()
        try:
            doc = session.run(BenchOptions(**{**base, **fields}), lambda *a, **k: None)
        except Exception as exc:  # saved with the others
            doc = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        wall = time.monotonic() - started
        doc["gpu_local"] = {"device": torch.cuda.get_device_name(0) if on_gpu else "cpu", "wall_s": round(wall, 1)}
        (out / f"gpu-bench-{name}.json").write_text(json.dumps(doc, indent=1))
        print(summary(name, doc, wall), flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
