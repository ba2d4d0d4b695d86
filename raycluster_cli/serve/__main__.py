"""``python -m raycluster_cli.serve``: deploy the service on the Ray cluster this node belongs to.

Run inside a node's container (or as a Ray job): it connects to the running cluster, finds the alive
nodes, measures each one's cost per block with the bench's calibration, places floor(N/S) replicas
of S stages (``placement.pipelines``: each replica's blocks split min-max over its nodes' speeds), starts
Ray Serve's HTTP proxy on ``--host:--port``, deploys the model and returns once a real generation
went through every stage of every replica, printing one JSON line:

    {"url": "http://IP:PORT/v1", "model": ID, "replicas": R, "split": [[a, b], ...] (replica 0's unit ranges),
     "pipelines": [{"stages": [{"units": [a, b], "blocks": k, "node_ip": IP, "node_id": ID, "stage_s": s}, ...],
                    "why": "..."}, ...],
     "nodes": [{"node_id": ID, "node_ip": IP, "block_s": s}, ...], "why": "...", "dtype": D}

A diffusers checkpoint (``model_index.json``) is served as the images API instead (serve/image_launch.py: the
bench's placement and replicas, routed by measured speed).

Units are the model's embedding (0), blocks (1..L) and head (L+1); ``[a, b)`` is half-open;
``stage_s`` is the modelled seconds of the stage per calibration step (absent when not measured).  The application outlives this
process, as Ray Serve applications do; ``serve.delete`` or ``serve shutdown`` removes it.  Callers present one of
the service's own keys (``--keys-file``, digests only; serve/auth.py), never the cluster's Ray token.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray
from ray import serve

from raycluster_cli.apikeys import parse_keys
from raycluster_cli.diffusion.parts import is_diffusers_folder
from raycluster_cli.models.config import ModelConfig
from raycluster_cli.models.decoder import config_from_checkpoint
from raycluster_cli.node import nodes
from raycluster_cli.node.nodes import measure_rooms
from raycluster_cli.placement import memory
from raycluster_cli.placement.partition import DoesNotFit
from raycluster_cli.placement.pipelines import NodeSpeed, plan_replicas
from raycluster_cli.serve import image_launch
from raycluster_cli.serve.app import build_app
from raycluster_cli.serve.fleet import Calibration, alive_nodes, measure
from raycluster_cli.serve.scheduler import Limits
from raycluster_cli.serve.settings import ServeSettings
from raycluster_cli.serve.stages import split_units

APP_NAME = "raycluster"
# The ingress holds every stream and every pipeline's engine: it lives on the head, beside the HTTP proxy
# (HeadOnly) and the GCS, so losing any worker node never takes it down.  Serve spreads replicas over the
# nodes otherwise, and
# an ingress on the node that died would fail every request it held.
INGRESS_ACTOR_OPTIONS = {"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m raycluster_cli.serve", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True, help="a Hugging Face checkpoint folder on every node")
    p.add_argument("--model-id", default="", help="the name clients pass as model (default: the folder's name)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--stages", type=int, default=1, help="stages per pipeline (replica)")
    p.add_argument("--split", default="", help="blocks per stage, e.g. 4,3,3 (default: balanced by measured speed)")
    p.add_argument("--replicas", type=int, default=0, help="pipelines (default 0: as many as nodes allow, N // stages)")
    p.add_argument("--no-measure", action="store_true", help="skip the calibration: even split (or --split)")
    p.add_argument("--calibrate-repeats", type=int, default=3, help="timed rounds per node (median kept)")
    p.add_argument("--calibrate-sample-s", type=float, default=0.1, help="least seconds per timed sample")
    p.add_argument("--replace-period", type=float, default=30.0, help="seconds between looks for nodes to take in")
    p.add_argument(
        "--steps-in-flight",
        type=int,
        default=0,
        help="steps travelling through a pipeline at once (default 0: one per stage); more keep every stage fed"
        " while a step is back at the ingress being sampled, at slots x steps KV slots per stage",
    )
    p.add_argument(
        "--links",
        choices=["direct", "ray"],
        default="direct",
        help="how a step travels between stages: direct links (torch.distributed over TCP between the stages'"
        " nodes; Ray's calls where they do not form) or Ray's calls only",
    )
    p.add_argument(
        "--rebalance-period",
        type=float,
        default=20.0,
        help="seconds between looks at the stages' times under load, re-splitting a pipeline they show unbalanced"
        " (0: never)",
    )
    p.add_argument(
        "--slots",
        type=int,
        default=16,
        help="sequences in one step (a pipeline of S stages keeps S steps in flight: S x slots KV slots)",
    )
    p.add_argument(
        "--max-seq",
        type=int,
        default=0,
        help=f"prompt + generated tokens per sequence (0: the checkpoint's own limit, at most {MAX_SEQ_DEFAULT})",
    )
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="weights, KV cache and activations; auto: the checkpoint's dtype when every node has a GPU, else float32",
    )
    p.add_argument(
        "--keys-file",
        default="",
        help="the service's keys document (digests of its API keys, raycluster_cli.apikeys), read again when it"
        " changes; never the Ray cluster's token",
    )
    p.add_argument("--no-auth", action="store_true", help="accept requests without a key (loopback tests only)")
    p.add_argument("--key-max-requests", type=int, default=0, help="requests in flight per key (0: no bound)")
    p.add_argument("--key-max-tokens", type=int, default=0, help="tokens in flight per key (0: no bound)")
    p.add_argument("--tls-cert", default="", help="the API's certificate (PEM), with --tls-key: HTTPS")
    p.add_argument("--tls-key", default="", help="the API's private key (PEM)")
    p.add_argument("--record", default="", help="also write the JSON document to this file (for `raycluster status`)")
    p.add_argument(
        "--proxy-location",
        default="HeadOnly",
        help="Ray Serve's HTTP proxies: HeadOnly (one, on --host) or EveryNode (then --host must be 0.0.0.0)",
    )
    image_launch.add_arguments(p)
    return p


MAX_SEQ_DEFAULT = 4096


def default_max_seq(model_path: str) -> int:
    """The checkpoint's own positions (``max_position_embeddings``, GPT-2's ``n_positions``), at most
    ``MAX_SEQ_DEFAULT``: every KV slot is reserved at ``max_seq`` tokens, and checkpoints declare 32k-128k
    positions (Llama-3.2: 131 072), which would reserve tens of GiB for 16 slots; 4096 holds the prompts of a
    chat or a benchmark (up to 2048 tokens and their answer).  A longer context is ``--max-seq``'s to ask."""
    raw = _read_config(Path(model_path) / "config.json")
    found = raw.get("max_position_embeddings", raw.get("n_positions", raw.get("n_ctx")))
    return min(int(found), MAX_SEQ_DEFAULT) if isinstance(found, int) and found > 1 else MAX_SEQ_DEFAULT


def _read_config(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # the checkpoint's loader names what is wrong with it
    return raw if isinstance(raw, dict) else {}


def _keys_file(args: argparse.Namespace) -> str | None:
    """The keys document's path (checked readable now, so a wrong path fails the launch, not every request)."""
    if args.no_auth:
        return None
    if not args.keys_file:
        raise SystemExit("serve: no API keys: pass --keys-file (the service's keys document), or --no-auth")
    try:
        parse_keys(Path(args.keys_file).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"serve: --keys-file {args.keys_file}: {exc}") from None
    return str(args.keys_file)


def http_options(args: argparse.Namespace) -> dict[str, Any]:
    """Ray Serve's HTTP proxy: the address and port, HTTPS when given a certificate and its key."""
    options: dict[str, Any] = {"host": args.host, "port": args.port}
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("serve: --tls-cert and --tls-key go together")
    if args.tls_cert:
        options |= {"ssl_certfile": args.tls_cert, "ssl_keyfile": args.tls_key}
    return options


def _on_gpus() -> bool:
    """Every alive node offers Ray a GPU (what ``--dtype auto`` keeps the checkpoint's dtype for)."""
    alive = nodes.alive_nodes()
    return bool(alive) and all(n["gpus"] >= 1 for n in alive)


def _rooms(cfg: ModelConfig, args: argparse.Namespace, node_ids: list[str]) -> tuple[dict[str, int], memory.Demand]:
    """Each node's bytes for a stage's units (after a step's room), and the model's demand; refuses, with the
    numbers, a model no split over ``--stages`` nodes can hold."""
    capacities = measure_rooms(node_ids, timeout_s=120)
    # each stage holds --slots KV slots for each step in flight (Limits.for_steps): --steps-in-flight, else --stages
    need = memory.demand(cfg, rows=args.slots * (args.steps_in_flight or args.stages), tokens=args.prefill_chunk)
    memory.check_fits(need, capacities, args.stages)
    return {c.node_id: max(0, c.usable - need.fixed) for c in capacities}, need


def _placement(args: argparse.Namespace, settings: ServeSettings, layers: int) -> ServeSettings:
    """The settings with the replicas placed on the alive nodes, by their measured speeds unless told not."""
    cfg = config_from_checkpoint(args.model_path, max_seq=args.max_seq, dtype=settings.dtype)
    nodes = alive_nodes()
    try:
        rooms, need = _rooms(cfg, args, list(nodes))  # before any weights are built anywhere
    except DoesNotFit as exc:
        raise SystemExit(f"serve: {exc}") from None
    if args.no_measure:
        speeds = [NodeSpeed(node_id, ip, ()) for node_id, ip in nodes.items()]
    else:
        calibration = Calibration(
            batch=min(args.slots, 8),
            repeats=args.calibrate_repeats,
            min_sample_s=args.calibrate_sample_s,
            prefill_chunk=args.prefill_chunk,
        )
        speeds = measure(cfg, nodes, calibration)
    speeds = [replace(s, capacity=rooms.get(s.node_id)) for s in speeds]
    given = split_units(layers, args.stages, settings.split) if settings.split or args.no_measure else None
    try:
        plans = plan_replicas(speeds, args.stages, args.replicas, given, unit_bytes=list(need.units))
    except DoesNotFit as exc:
        raise SystemExit(f"serve: {exc}") from None
    measured = tuple(s for s in speeds if s.unit_costs)
    return replace(
        settings,
        plans=tuple(plans),
        speeds=measured,
        replicas=len(plans),
        unit_bytes=tuple(need.units),
        stage_fixed_bytes=need.fixed,
    )


def _report(url: str, settings: ServeSettings, layers: int) -> dict[str, Any]:
    plans = settings.plans
    return {
        "url": url,
        "model": settings.served_model,
        "replicas": len(plans),
        "split": [list(r) for r in plans[0].ranges],
        "pipelines": [plan.to_json(layers) for plan in plans],
        "nodes": [{"node_id": s.node_id, "node_ip": s.ip, "block_s": s.block_s} for s in settings.speeds],
        "why": plans[0].why,
        "dtype": settings.dtype,
    }


def _settings(args: argparse.Namespace, keys_file: str | None) -> ServeSettings:
    """The service's settings from the flags, before any placement."""
    split = tuple(int(c) for c in args.split.split(",")) if args.split else None
    return ServeSettings(
        model_path=args.model_path,
        model_id=args.model_id,
        keys_file=keys_file,
        key_max_requests=args.key_max_requests or None,
        key_max_tokens=args.key_max_tokens or None,
        stages=args.stages,
        split=split,
        limits=Limits(slots=args.slots, max_seq=args.max_seq, prefill_chunk=args.prefill_chunk),
        replace_period_s=args.replace_period,
        rebalance_period_s=0.0 if split else args.rebalance_period,  # a split the operator gave is kept
        max_in_flight=args.steps_in_flight or None,
        links=args.links,
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if is_diffusers_folder(args.model_path):  # the images API (serve/image_launch.py)
        return image_launch.launch(args, _keys_file(args), APP_NAME, INGRESS_ACTOR_OPTIONS, http_options(args))
    args.max_seq = args.max_seq or default_max_seq(args.model_path)
    settings = _settings(args, _keys_file(args))
    layers = config_from_checkpoint(args.model_path, max_seq=args.max_seq).layers
    split_units(layers, args.stages, settings.split)  # a bad split fails here, before anything starts
    ray.init(address="auto")
    cfg = config_from_checkpoint(args.model_path, max_seq=args.max_seq, dtype=args.dtype, on_gpu=_on_gpus())
    settings = _placement(args, replace(settings, dtype=cfg.dtype), layers)
    serve.start(proxy_location=args.proxy_location, http_options=http_options(args))
    serve.run(build_app(settings, ray_actor_options=INGRESS_ACTOR_OPTIONS), name=APP_NAME, route_prefix="/")
    scheme = "https" if args.tls_cert else "http"
    url = f"{scheme}://{ray.util.get_node_ip_address()}:{args.port}/v1"
    document = json.dumps(_report(url, settings, layers))
    if args.record:
        Path(args.record).write_text(document + "\n")
    print(document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
