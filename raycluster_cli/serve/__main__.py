"""``python -m raycluster_cli.serve``: deploy the service on the Ray cluster this node belongs to.

Run inside a node's container (or as a Ray job) with ``--options @FILE`` (or ``--options JSON``): the JSON of
serve/options.py's ``LaunchOptions``, the model `raycluster serve`'s flags are made of, so no flag is written twice.
It connects to the running cluster, finds the alive nodes, measures each one's cost per block with the bench's
calibration, places floor(N/S) replicas of S stages (``placement.pipelines``: each replica's blocks split min-max
over its nodes' speeds), starts Ray Serve's HTTP proxy on ``host:port``, deploys the model and returns once a real
generation went through every stage of every replica, printing one JSON line:

    {"url": "http://IP:PORT/v1", "model": ID, "replicas": R, "split": [[a, b], ...] (replica 0's unit ranges),
     "pipelines": [{"stages": [{"units": [a, b], "blocks": k, "node_ip": IP, "node_id": ID, "stage_s": s}, ...],
                    "why": "..."}, ...],
     "nodes": [{"node_id": ID, "node_ip": IP, "block_s": s}, ...], "why": "...", "dtype": D}

A diffusers checkpoint (``model_index.json``) is served as the images API instead (serve/image_launch.py: the
bench's placement and replicas, routed by measured speed).

Units are the model's embedding (0), blocks (1..L) and head (L+1); ``[a, b)`` is half-open;
``stage_s`` is the modelled seconds of the stage per calibration step (absent when not measured).  The application outlives this
process, as Ray Serve applications do; ``serve.delete`` or ``serve shutdown`` removes it.  Callers present one of
the service's own keys (``keys_file``, digests only; serve/auth.py), never the cluster's Ray token.
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
from raycluster_cli.node.vllm_server import VllmLaunch
from raycluster_cli.placement import memory
from raycluster_cli.placement.partition import DoesNotFit
from raycluster_cli.placement.pipelines import NodeSpeed, plan_replicas
from raycluster_cli.placement.vllm_split import VllmNode, VllmSplit, best_pipeline
from raycluster_cli.serve import image_launch, revive
from raycluster_cli.serve.app import build_app
from raycluster_cli.serve.fleet import Calibration, alive_nodes, measure
from raycluster_cli.serve.options import (
    KV_BLOCK,
    KV_SLOTS_DEFAULT,
    MAX_SEQ_DEFAULT,
    LaunchOptions,
    ValidationError,
    default_slots,
    problem,
)
from raycluster_cli.serve.scheduler import Limits
from raycluster_cli.serve.settings import ServeSettings
from raycluster_cli.serve.stages import split_units

APP_NAME = "raycluster"
# The ingress holds every stream and every pipeline's engine: it lives on the head, beside the HTTP proxy
# (HeadOnly) and the GCS, so losing any worker node never takes it down.  Serve spreads replicas over the
# nodes otherwise, and
# an ingress on the node that died would fail every request it held.
INGRESS_ACTOR_OPTIONS = {"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}}


def default_max_seq(model_path: str) -> int:
    """The checkpoint's own positions (``max_position_embeddings``, GPT-2's ``n_positions``), at most
    ``MAX_SEQ_DEFAULT``: the default KV budget is ``KV_SLOTS_DEFAULT`` sequences at ``max_seq`` tokens, and
    checkpoints declare 32k-128k positions (Llama-3.2: 131 072), which would budget tens of GiB; 4096 holds the prompts of a
    chat or a benchmark (up to 2048 tokens and their answer).  A longer context is ``--max-seq``'s to ask."""
    raw = _read_config(Path(model_path) / "config.json")
    found = raw.get("max_position_embeddings", raw.get("n_positions", raw.get("n_ctx")))
    return min(int(found), MAX_SEQ_DEFAULT) if isinstance(found, int) and found > 1 else MAX_SEQ_DEFAULT


def resolved(options: LaunchOptions) -> LaunchOptions:
    """The options with their defaults that depend on the checkpoint or on each other made numbers: ``max_seq``
    (the checkpoint's), ``kv_tokens`` (``KV_SLOTS_DEFAULT`` sequences at ``max_seq`` in whole KV blocks: as many
    full-context sequences as 16 slots held),
    ``slots`` (``options.default_slots``); a budget smaller than one sequence at ``max_seq`` is refused."""
    max_seq = options.max_seq or default_max_seq(options.model_path)
    sequence = -(-max_seq // KV_BLOCK) * KV_BLOCK  # a full-context sequence's positions, in whole blocks
    kv_tokens = options.kv_tokens or KV_SLOTS_DEFAULT * sequence
    if kv_tokens // KV_BLOCK * KV_BLOCK < sequence:  # a request the context allows would never fit
        raise SystemExit(
            f"serve: --kv-tokens {kv_tokens} holds less than one sequence of --max-seq {max_seq}:"
            f" give at least {sequence} (whole blocks of {KV_BLOCK}), or a shorter --max-seq"
        )
    slots = options.slots or default_slots(kv_tokens)
    return options.model_copy(update={"max_seq": max_seq, "kv_tokens": kv_tokens, "slots": slots})


def _read_config(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # the checkpoint's loader names what is wrong with it
    return raw if isinstance(raw, dict) else {}


def _keys_file(options: LaunchOptions) -> str | None:
    """The keys document's path (checked readable now, so a wrong path fails the launch, not every request)."""
    if options.no_auth:
        return None
    if not options.keys_file:
        raise SystemExit("serve: no API keys: pass --keys-file (the service's keys document), or --no-auth")
    try:
        parse_keys(Path(options.keys_file).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"serve: --keys-file {options.keys_file}: {exc}") from None
    return str(options.keys_file)


def http_options(options: LaunchOptions) -> dict[str, Any]:
    """Ray Serve's HTTP proxy: the address and port, HTTPS when given a certificate and its key."""
    http: dict[str, Any] = {"host": options.host, "port": options.port}
    if bool(options.tls_cert) != bool(options.tls_key):
        raise SystemExit("serve: --tls-cert and --tls-key go together")
    if options.tls_cert:
        http |= {"ssl_certfile": options.tls_cert, "ssl_keyfile": options.tls_key}
    return http


def _on_gpus() -> bool:
    """Every alive node offers Ray a GPU (what ``--dtype auto`` keeps the checkpoint's dtype for)."""
    alive = nodes.alive_nodes()
    return bool(alive) and all(n["gpus"] >= 1 for n in alive)


def _rooms(cfg: ModelConfig, options: LaunchOptions, node_ids: list[str]) -> tuple[dict[str, int], memory.Demand]:
    """Each node's bytes for a stage's units (after a step's room), and the model's demand; refuses, with the
    numbers, a model no split over ``--stages`` nodes can hold."""
    capacities = measure_rooms(node_ids, timeout_s=120)
    # each stage holds --kv-tokens positions and --slots rows for each step in flight (Limits.for_steps):
    # --steps-in-flight, else --stages
    steps = options.steps_in_flight or options.stages
    need = memory.demand(
        cfg,
        rows=options.slots * steps,
        tokens=options.prefill_chunk,
        kv_tokens=options.kv_tokens * steps,
        step_tokens=options.step_tokens * steps,
    )
    memory.check_fits(need, capacities, options.stages)
    return {c.node_id: max(0, c.usable - need.fixed) for c in capacities}, need


def _placement(options: LaunchOptions, settings: ServeSettings, layers: int) -> ServeSettings:
    """The settings with the replicas placed on the alive nodes, by their measured speeds unless told not."""
    cfg = config_from_checkpoint(options.model_path, max_seq=options.max_seq, dtype=settings.dtype)
    nodes = alive_nodes()
    try:
        rooms, need = _rooms(cfg, options, list(nodes))  # before any weights are built anywhere
    except DoesNotFit as exc:
        raise SystemExit(f"serve: {exc}") from None
    if options.no_measure:
        speeds = [NodeSpeed(node_id, ip, ()) for node_id, ip in nodes.items()]
    else:
        calibration = Calibration(
            batch=min(options.slots, 8),
            repeats=options.calibrate_repeats,
            min_sample_s=options.calibrate_sample_s,
            prefill_chunk=options.prefill_chunk,
        )
        speeds = measure(cfg, nodes, calibration)
    speeds = [replace(s, capacity=rooms.get(s.node_id)) for s in speeds]
    given = split_units(layers, options.stages, settings.split) if settings.split or options.no_measure else None
    try:
        plans = plan_replicas(speeds, options.stages, options.replicas, given, unit_bytes=list(need.units))
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


def _vllm(options: LaunchOptions, settings: ServeSettings, cfg: ModelConfig, on_gpu: bool) -> ServeSettings:
    """``--engine vllm``: a vLLM server on every alive node (one replica each, requests to the least busy), or with
    ``--stages`` S > 1 one vLLM pipeline over the S fastest measured nodes, its layers split by ``best_pipeline``;
    a CPU rank's KV room (``VLLM_CPU_KVCACHE_SPACE``, whole GiB) holds ``--kv-tokens`` on its layers."""
    env: tuple[tuple[str, str], ...] = ()
    layers, alone = cfg.layers, tuple(alive_nodes())
    pipelines: tuple[tuple[str, ...], ...] = ()
    split = None
    if options.stages > 1:
        split = _vllm_split(options, cfg, on_gpu)
        env, layers, pipelines, alone = tuple(split.env().items()), max(split.layers), (split.node_ids,), ()
    kv_gib = max(1, -(-layers * cfg.kv_bytes(options.kv_tokens) // (1 << 30)))
    launch = VllmLaunch(
        python=options.vllm_python,
        model_path=options.model_path,
        served_model=settings.served_model,
        dtype=cfg.dtype,
        max_model_len=options.max_seq,
        env=env + (() if on_gpu else (("VLLM_CPU_KVCACHE_SPACE", str(kv_gib)),)),
        start_timeout_s=max(60.0, options.timeout - 60.0),
    )
    return replace(settings, vllm=launch, vllm_nodes=alone, vllm_pipelines=pipelines, vllm_split=split)


def _vllm_split(options: LaunchOptions, cfg: ModelConfig, on_gpu: bool) -> VllmSplit:
    """The pipeline's nodes, order and layers from every alive node's measured costs and memory room."""
    nodes = alive_nodes()
    try:
        rooms, _ = _rooms(cfg, options, list(nodes))
        calibration = Calibration(batch=min(options.slots, 8), repeats=options.calibrate_repeats,
                                  min_sample_s=options.calibrate_sample_s, prefill_chunk=options.prefill_chunk)  # fmt: skip
        candidates = [
            VllmNode(s, rooms[s.node_id], rooms[s.node_id], 1 if on_gpu else 0)
            for s in measure(cfg, nodes, calibration)
        ]
        return best_pipeline(cfg, candidates, options.stages, options.kv_tokens)
    except (DoesNotFit, ValueError) as exc:
        raise SystemExit(f"serve: {exc}") from None


def _vllm_report(url: str, settings: ServeSettings, layers: int) -> dict[str, Any]:
    """The launcher's document for ``--engine vllm``, shaped as ours: a replica's stages with their layers."""
    split = settings.vllm_split
    alone = "a vLLM server on this node (--engine vllm), requests to the least busy replica"
    pipelines = [{"stages": [{"node_id": n, "blocks": layers}], "why": alone} for n in settings.vllm_nodes]
    if split is not None:
        stages = [{"node_id": n, "node_ip": ip, "blocks": count} for n, ip, count in zip(split.node_ids, split.ips, split.layers, strict=True)]  # fmt: skip
        pipelines.append({"stages": stages, "why": split.why})
    return {
        "url": url,
        "model": settings.served_model,
        "engine": "vllm",
        "replicas": len(pipelines),
        "split": list(split.layers) if split else None,
        "pipelines": pipelines,
        "vllm": split.to_json() if split else None,
        "why": pipelines[0]["why"] if pipelines else "",
        "dtype": settings.dtype,
    }


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
        "quantize": settings.quantize or "none",
    }


def _settings(options: LaunchOptions, keys_file: str | None) -> ServeSettings:
    """The deployment's runtime settings from the launcher's options, before any placement."""
    split = options.split_counts
    return ServeSettings(
        model_path=options.model_path,
        model_id=options.model_id,
        keys_file=keys_file,
        key_max_requests=options.key_max_requests or None,
        key_max_tokens=options.key_max_tokens or None,
        stages=options.stages,
        split=split,
        limits=Limits(
            slots=options.slots,
            max_seq=options.max_seq,
            prefill_chunk=options.prefill_chunk,
            step_tokens=options.step_tokens,
            kv_tokens=options.kv_tokens,
            kv_block=KV_BLOCK,
        ),
        replace_period_s=options.replace_period,
        rebalance_period_s=0.0 if split else options.rebalance_period,  # a split the operator gave is kept
        max_in_flight=options.steps_in_flight or None,
        links=options.links,
        quantize="" if options.quantize == "none" else options.quantize,
    )


def read_options(argv: list[str]) -> LaunchOptions:
    """The launcher's options: ``--options @FILE`` (the file `raycluster serve` writes in the head's container)
    or ``--options JSON``, LaunchOptions' fields; a bad one is one line naming its flag."""
    parser = argparse.ArgumentParser(prog="python -m raycluster_cli.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--options", required=True, help="@FILE or JSON: serve/options.py's LaunchOptions")
    given = parser.parse_args(argv).options
    try:
        return LaunchOptions.model_validate_json(Path(given[1:]).read_text() if given.startswith("@") else given)
    except OSError as exc:
        raise SystemExit(f"serve: --options {given}: {exc.strerror or exc}") from None
    except ValidationError as exc:
        message, flag = problem(exc)
        where = f"what {flag} takes" if flag else "the options"
        raise SystemExit(f"serve: {message} (serve/options.py's LaunchOptions says {where})") from None


def main(argv: list[str] | None = None) -> int:
    given = read_options(sys.argv[1:] if argv is None else argv)
    if is_diffusers_folder(given.model_path):  # the images API (serve/image_launch.py)
        return image_launch.launch(given, _keys_file(given), APP_NAME, INGRESS_ACTOR_OPTIONS, http_options(given))
    options = resolved(given)
    settings = _settings(options, _keys_file(options))
    layers = config_from_checkpoint(options.model_path, max_seq=options.max_seq).layers
    split_units(layers, options.stages, settings.split)  # a bad split fails here, before anything starts
    ray.init(address="auto")
    on_gpu = _on_gpus()
    if on_gpu and settings.quantize:
        raise SystemExit("serve: --quantize int8 runs on CPU stages; on GPUs serve without --quantize")
    cpu_bf16 = options.dtype == "auto" and not on_gpu and nodes.all_native_bf16(list(alive_nodes()), timeout_s=60)
    cfg = config_from_checkpoint(
        options.model_path, max_seq=options.max_seq, dtype=options.dtype, on_gpu=on_gpu, cpu_bf16=cpu_bf16
    )
    settings = replace(settings, dtype=cfg.dtype)
    if options.engine == "vllm":
        settings = _vllm(options, settings, cfg, on_gpu)
    else:
        settings = _placement(options, settings, layers)
    serve.start(proxy_location=options.proxy_location, http_options=http_options(options))
    serve.run(build_app(settings, ray_actor_options=INGRESS_ACTOR_OPTIONS), name=APP_NAME, route_prefix="/")
    scheme = "https" if options.tls_cert else "http"
    url = f"{scheme}://{ray.util.get_node_ip_address()}:{options.port}/v1"
    report = _vllm_report(url, settings, layers) if settings.vllm else _report(url, settings, layers)
    document = json.dumps(report)
    if options.record:
        Path(options.record).write_text(document + "\n")
    if options.revive:  # the options as given: a redeploy resolves their defaults on the nodes it then finds
        revive.write(options.revive, given.model_dump(mode="json"), report)
    print(document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
