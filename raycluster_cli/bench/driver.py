"""``python -m raycluster_cli.bench.driver``: run the sharded-inference benchmark on the Ray cluster.

Runs inside the head container, connects to the running cluster, puts one pipeline stage on each
alive node (sorted by IP) and prints exactly one JSON document on stdout; everything else goes to
stderr.  To make that hold even for output from C extensions and Ray itself, file descriptor 1 is
pointed at stderr for the whole run and the JSON is written to a saved copy of the original fd.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, NoReturn

SCHEMA_VERSION = 1
log = logging.getLogger("raycluster.bench")


class _JsonArgumentParser(argparse.ArgumentParser):
    """Usage errors become the same one-line JSON error as everything else (exit 1)."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


class _UsageError(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = _JsonArgumentParser(prog="python -m raycluster_cli.bench.driver", description=__doc__)
    p.add_argument(
        "--model-path",
        default=None,
        help="GPT-2 or Llama checkpoint dir (Hugging Face config.json + safetensors) on every node",
    )
    p.add_argument("--layers", type=int, default=12, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--max-seq", type=int, default=None, help="default: prompt-len + max-new-tokens")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--prefill-chunk", type=int, default=0, help="prompt tokens per prefill step (0: whole prompt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stages", type=int, default=None, help="stages per replica (default: number of alive nodes)")
    p.add_argument("--replicas", type=int, default=None, help="pipeline replicas (default: alive nodes // stages)")
    p.add_argument("--mode", choices=("offline", "poisson"), default=None, help="offline: all requests at once")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s (implies --mode poisson)")
    p.add_argument("--sweep", choices=("batch", "nodes"), default=None, help="micro-batch sizes, or 1..N nodes")
    p.add_argument("--sweep-max-batch", type=int, default=None, help="largest micro-batch of --sweep batch")
    p.add_argument("--references", action=argparse.BooleanOptionalAction, default=True, help="even + unsharded runs")
    p.add_argument("--refine", type=int, default=3, help="pilot runs that correct the calibration (balanced)")
    p.add_argument("--calibration-sample-s", type=float, default=0.25, help="least seconds per calibration sample")
    p.add_argument("--calibration-repeats", type=int, default=5, help="timed rounds per unit type (median kept)")
    p.add_argument(
        "--partition",
        default="even",
        help="even | balanced (calibrated per node) | manual:4,4,4 (blocks per stage)",
    )
    p.add_argument(
        "--in-flight",
        type=int,
        default=None,
        help="micro-batches in flight per replica (default offline: all, up to 4 x stages; Poisson: 2 x stages)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads per stage (default: node CPUs)")
    p.add_argument("--allow-shared-nodes", action="store_true", help="let stages share nodes (testing)")
    p.add_argument("--check-output", action="store_true", help="compare tokens with the unsharded model")
    p.add_argument("--check-requests", type=int, default=8, help="requests compared by --check-output")
    return p


def _normalise(args: argparse.Namespace) -> argparse.Namespace:
    if args.mode is None:
        args.mode = "poisson" if args.rate is not None else "offline"
    if args.refine < 0:
        raise ValueError(f"--refine must be >= 0, got {args.refine}")
    if args.calibration_repeats < 1:
        raise ValueError(f"--calibration-repeats must be >= 1, got {args.calibration_repeats}")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    from raycluster_cli.bench import experiment

    return experiment.run(args)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:2000]


def _run_to_doc(argv: list[str] | None) -> tuple[dict[str, Any], int]:
    try:
        return run(_normalise(build_parser().parse_args(argv))), 0
    except (Exception, KeyboardInterrupt) as exc:  # the CLI wants one JSON document, whatever happened
        log.error("benchmark failed", exc_info=not isinstance(exc, _UsageError | ValueError))
        return {"schema_version": SCHEMA_VERSION, "ok": False, "error": _one_line(exc)}, 1
    finally:
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        except Exception:  # shutdown problems must not hide the result
            log.warning("ray.shutdown failed", exc_info=True)


def main(argv: list[str] | None = None) -> int:
    sys.stdout.flush()
    json_fd = os.dup(1)
    os.dup2(2, 1)  # anything else that writes to stdout now lands on stderr
    try:
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
        doc, code = _run_to_doc(argv)
        sys.stdout.flush()
        os.write(json_fd, (json.dumps(doc) + "\n").encode())
    finally:
        os.dup2(json_fd, 1)
        os.close(json_fd)
    return code


if __name__ == "__main__":
    sys.exit(main())
