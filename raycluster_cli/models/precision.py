"""``--dtype auto`` on CPUs: float32 unless one block measured clearly faster in bfloat16 on every stage node.

Whether bfloat16 pays on a CPU depends on the CPU (native bf16 dot products: AVX512-BF16, AMX) and on
torch's kernels, so it is measured, not guessed: each node times one block of the run's model on the
run's micro-batch (prefill + decode steps) in both dtypes, all nodes at once, and bfloat16 is chosen
only when it won everywhere.  On GPUs ``auto`` keeps the checkpoint's dtype (``config.resolve_dtype``).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

from raycluster_cli.models.decoder import ModelConfig, Stage, seconds_per_pass

PROBED = ("float32", "bfloat16")


def block_seconds(
    cfg: ModelConfig, dtype: str, device: str, batch: int, prompt_len: int, decode_steps: int, min_sample_s: float
) -> float:
    """Median seconds of one micro-batch (prefill + ``decode_steps``) through one block held in ``dtype``."""
    import torch

    stage = Stage(replace(cfg, dtype=dtype), 1, 2, device=device)
    hidden = torch.randn(batch, prompt_len, cfg.d_model, generator=torch.Generator().manual_seed(cfg.seed))
    samples: list[float] = []
    for round_ in range(4):  # round 0 warms up: one pass
        seconds, _ = seconds_per_pass(stage, hidden, prompt_len, decode_steps, min_sample_s if round_ else 0.0, "probe")
        if round_:
            samples.append(seconds)
    return statistics.median(samples)


def probe(workers: list[Any], options: Any) -> list[dict[str, Any]]:
    """Every worker's ``probe_dtypes`` on the run's micro-batch, all nodes at once."""
    import ray

    o = options
    steps = max(1, o.max_new_tokens - 1)
    calls = [w.probe_dtypes.remote(o.micro_batch, o.prompt_len, steps, o.calibration_sample_s) for w in workers]
    return list(ray.get(calls))


# bfloat16 must beat float32 by more than the run-to-run noise of a timing (about ±10 % on a shared machine): a
# smaller lead is not a measured gain, and bfloat16 changes the model's numbers (greedy tokens of a sharded run
# may then differ from the unsharded reference's; seen on the lab with leads of 3-7 %).
MIN_GAIN = 0.15


def choose(probes: list[dict[str, Any]]) -> dict[str, Any]:
    """The dtype for a CPU run from every node's probe (``{"node_ip", "float32_s", "bfloat16_s"}``)."""
    faster = bool(probes) and all(p["bfloat16_s"] < (1 - MIN_GAIN) * p["float32_s"] for p in probes)
    why = (
        f"bfloat16: one block measured over {MIN_GAIN:.0%} faster in bfloat16 on every node"
        if faster
        else f"float32: bfloat16 was not over {MIN_GAIN:.0%} faster on every node"
    )
    return {"dtype": "bfloat16" if faster else "float32", "why": why, "probes": probes}
