"""``python -m raycluster_cli.bench.driver``: run the sharded-inference benchmark on the Ray cluster.

Runs inside the head container, connects to the running cluster, puts one pipeline stage on each
alive node (sorted by IP) and prints exactly one JSON document on stdout; everything else goes to
stderr.  To make that hold even for output from C extensions and Ray itself, file descriptor 1 is
pointed at stderr for the whole run and the JSON is written to a saved copy of the original fd.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import sys
import time
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
    p.add_argument("--layers", type=int, default=12, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--max-seq", type=int, default=None, help="default: prompt-len + max-new-tokens")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stages", type=int, default=None, help="default: number of alive nodes")
    p.add_argument(
        "--partition",
        default="even",
        help="even | balanced (calibrated per node) | manual:4,4,4 (blocks per stage)",
    )
    p.add_argument("--in-flight", type=int, default=None, help="micro-batches in flight (min and default: stages+1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per stage (default: node CPUs)")
    p.add_argument("--allow-shared-nodes", action="store_true", help="let stages share nodes (testing)")
    p.add_argument("--check-output", action="store_true", help="compare tokens with the unsharded model")
    p.add_argument("--check-requests", type=int, default=8, help="requests compared by --check-output")
    return p


def _ip_key(ip: str) -> tuple[int, Any]:
    try:
        return (0, ipaddress.ip_address(ip))
    except ValueError:
        return (1, ip)


def alive_nodes() -> list[dict[str, str]]:
    """Alive Ray nodes as ``{"node_id", "node_ip"}``, sorted by IP (then id)."""
    import ray

    nodes = [
        {"node_id": str(n["NodeID"]), "node_ip": str(n.get("NodeManagerAddress", ""))}
        for n in ray.nodes()
        if n.get("Alive")
    ]
    nodes.sort(key=lambda n: (_ip_key(n["node_ip"]), n["node_id"]))
    return nodes


def choose_nodes(nodes: list[dict[str, str]], stages: int, allow_shared: bool) -> list[dict[str, str]]:
    if not nodes:
        raise RuntimeError("no alive Ray nodes")
    if stages < 1:
        raise ValueError(f"--stages must be >= 1, got {stages}")
    if stages > len(nodes) and not allow_shared:
        raise ValueError(
            f"{stages} stages but only {len(nodes)} alive node(s); one stage per node "
            "(use --allow-shared-nodes to stack stages for testing)"
        )
    return [nodes[i % len(nodes)] for i in range(stages)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from raycluster_cli.bench import metrics, partition, pipeline
    from raycluster_cli.bench.model import ModelConfig

    max_seq = args.max_seq or args.prompt_len + args.max_new_tokens
    cfg = ModelConfig(
        vocab=args.vocab,
        d_model=args.d_model,
        heads=args.heads,
        layers=args.layers,
        max_seq=max_seq,
        seed=args.seed,
    )
    params = pipeline.BenchParams(
        requests=args.requests,
        prompt_len=args.prompt_len,
        max_new_tokens=args.max_new_tokens,
        micro_batch=args.micro_batch,
        seed=args.seed,
        in_flight=args.in_flight,
    )
    params.validate(cfg)
    spec = str(args.partition)
    if spec not in ("even", "balanced") and not spec.startswith("manual:"):
        raise ValueError(f"--partition must be even, balanced or manual:N,N,..., got {spec!r}")
    manual_ranges = (
        partition.manual_partition(spec[len("manual:") :], cfg.layers) if spec.startswith("manual:") else None
    )

    started = time.perf_counter()
    ray.init(address="auto", logging_level=logging.ERROR, log_to_driver=False)
    nodes = alive_nodes()
    num_stages = args.stages or (len(manual_ranges) if manual_ranges else len(nodes))
    if manual_ranges is not None and len(manual_ranges) != num_stages:
        raise ValueError(f"manual partition has {len(manual_ranges)} stages but {num_stages} were asked for")
    placement = choose_nodes(nodes, num_stages, args.allow_shared_nodes)
    if manual_ranges is None:
        partition.even_partition(cfg.layers, num_stages)  # fail fast on impossible requests
    log.info("stages on %s", [n["node_ip"] for n in placement])

    workers = pipeline.start_workers(
        cfg,
        [n["node_id"] for n in placement],
        num_threads=args.threads,
        allow_shared_nodes=args.allow_shared_nodes,
    )
    unit_costs: list[list[float]] | None = None
    try:
        if manual_ranges is not None:
            ranges = manual_ranges
        elif spec == "balanced":
            unit_costs = pipeline.calibrate_workers(workers, params)
            ranges = partition.balanced_partition(unit_costs, 0.0)
        else:
            ranges = partition.even_partition(cfg.layers, num_stages)
        result = pipeline.run_pipeline(workers, ranges, cfg, params)
    finally:
        pipeline.stop_workers(workers)

    output_check = None
    if args.check_output:
        output_check = pipeline.check_output(cfg, params, result, args.check_requests)
    busy = [s.busy_s for s in result.stages]
    stages_out = result.stage_dicts()
    return {
        "schema_version": SCHEMA_VERSION,
        "ok": True,
        "config": {
            "model": cfg.to_dict(),
            "requests": params.requests,
            "prompt_len": params.prompt_len,
            "max_new_tokens": params.max_new_tokens,
            "micro_batch": params.micro_batch,
            "seed": params.seed,
            "stages": num_stages,
            "partition": spec,
            "partition_ranges": [list(r) for r in ranges],
            "unit_costs_s": unit_costs,
            "in_flight": result.in_flight,
            "threads": args.threads,
            "allow_shared_nodes": bool(args.allow_shared_nodes),
            "alive_nodes": len(nodes),
            "latency_origin": "micro_batch_admission",
        },
        "tokens_per_s": result.tokens_per_s,
        "requests_per_s": result.requests_per_s,
        "requests": result.requests,
        "completed": result.completed,
        "generated_tokens": result.generated_tokens,
        "wall_s": result.wall_s,
        "total_s": time.perf_counter() - started,
        "imbalance": metrics.imbalance(busy),
        "t_max_minus_t_min_s": metrics.spread(busy),
        "utilisation": metrics.utilisation(busy),
        "latency_s": {
            "ttft": metrics.latency_summary(result.ttft_s),
            "e2e": metrics.latency_summary(result.e2e_s),
        },
        "stages": stages_out,
        "output_check": output_check,
    }


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:2000]


def _run_to_doc(argv: list[str] | None) -> tuple[dict[str, Any], int]:
    try:
        return run(build_parser().parse_args(argv)), 0
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
