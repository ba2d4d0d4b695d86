"""`serve`: the balanced pipeline as an OpenAI-compatible service on the cluster (verbs/serve.py, serve/ in the
node image); `serve --stop` removes it."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from raycluster_cli.cli.common import DebugOpt, InventoryOpt, JsonOpt, emit, execute, open_cluster
from raycluster_cli.errors import UsageError
from raycluster_cli.render.base import Output


def serve_command(
    model_path: Annotated[
        str | None,
        typer.Option(
            "--model-path",
            help="a Hugging Face checkpoint folder on this machine (copied to every host that lacks it, verified), "
            "or a path every node already has",
        ),
    ] = None,
    port: Annotated[int, typer.Option(help="the service's port on the head's address")] = 8000,
    stages: Annotated[int | None, typer.Option(min=1, help="stages per pipeline (default: one per node)")] = None,
    slots: Annotated[int, typer.Option(min=1, help="sequences per step (a pipeline keeps one step per stage)")] = 16,
    max_seq: Annotated[
        int, typer.Option(min=0, help="prompt + generated tokens per sequence (0: the checkpoint's own, at most 4096)")
    ] = 0,
    model_id: Annotated[str, typer.Option(help="the model name clients pass (default: the folder's name)")] = "",
    dtype: Annotated[
        str,
        typer.Option(
            help="weights, KV cache and activations in auto | float32 | bfloat16 | float16; auto: the checkpoint's"
            " dtype when every node has a GPU, else float32"
        ),
    ] = "auto",
    image_steps: Annotated[
        int | None,
        typer.Option(min=1, max=500, help="a diffusers checkpoint: denoising steps when a request gives none (20)"),
    ] = None,
    image_max_steps: Annotated[
        int | None,
        typer.Option(min=1, help="a diffusers checkpoint: the most denoising steps a request may ask (150)"),
    ] = None,
    image_max_pixels: Annotated[
        int | None,
        typer.Option(min=64, help="a diffusers checkpoint: the most width x height a request may ask (1024 x 1024)"),
    ] = None,
    steps_in_flight: Annotated[
        int,
        typer.Option(
            min=0,
            help="steps travelling through a pipeline at once (0: one per stage); more keep every stage fed while"
            " a step is back at the ingress, at --slots x steps KV slots per stage",
        ),
    ] = 0,
    links: Annotated[
        str,
        typer.Option(
            help="how a step travels between stages: direct (torch.distributed links between the stages' nodes,"
            " TCP on free ports; Ray's calls where they do not form) or ray (Ray's calls only)",
        ),
    ] = "direct",
    rebalance_period: Annotated[
        float,
        typer.Option(
            min=0,
            help="seconds between looks at each stage's time per step under load: a pipeline they show unbalanced"
            " (a node slower than its calibration) is re-split over its nodes, the new one built before the old"
            " drains; 0: never",
        ),
    ] = 20.0,
    api_key_file: Annotated[
        str | None,
        typer.Option(help="the service's default API key from this file (default: one made and kept on this machine)"),
    ] = None,
    tls_cert: Annotated[str | None, typer.Option(help="serve the API over HTTPS with this certificate (PEM)")] = None,
    tls_key: Annotated[str | None, typer.Option(help="the private key (PEM) of --tls-cert")] = None,
    tls_self_signed: Annotated[
        bool, typer.Option("--tls-self-signed", help="serve over HTTPS with a certificate made here for the head")
    ] = False,
    key_max_requests: Annotated[
        int, typer.Option(min=0, help="requests in flight per API key unless the key says (0: no bound)")
    ] = 0,
    key_max_tokens: Annotated[
        int, typer.Option(min=0, help="tokens in flight (prompt + max_tokens, x n) per API key (0: no bound)")
    ] = 0,
    keys: Annotated[
        str | None,
        typer.Option(
            "--keys",
            help="the service's API keys instead: add NAME (a new key, its file printed, in effect at once), revoke"
            " NAME, list",
        ),
    ] = None,
    key_name: Annotated[
        str | None, typer.Argument(metavar="[NAME]", help="the key's name for --keys add/revoke")
    ] = None,
    max_requests: Annotated[
        int | None, typer.Option(min=1, help="--keys add: this key's requests in flight at most")
    ] = None,
    max_tokens: Annotated[
        int | None, typer.Option(min=1, help="--keys add: this key's tokens in flight at most")
    ] = None,
    stop: Annotated[bool, typer.Option("--stop", help="remove the service instead")] = False,
    timeout: Annotated[float, typer.Option(help="seconds the deployment may take")] = 900.0,
    inventory_path: InventoryOpt = None,
    json_mode: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Serve a model across the cluster as an OpenAI-compatible API (/v1/completions, /v1/chat/completions; a
    diffusers checkpoint, with model_index.json: /v1/images/generations, PNGs as b64_json).

    Returns once a real generation went through every stage; the service keeps running after this command
    (a second `serve` replaces it; `serve --stop` removes it; `status` shows it). Clients use the service's own
    API keys (`--keys add NAME`), never the cluster's Ray token. Exit 0: serving (or removed); 1: it did not
    start; 2: bad flags or inventory."""

    def action(output: Output) -> int:
        from raycluster_cli.render.operate import render_serve, render_serve_stop
        from raycluster_cli.verbs import serve

        if stop:
            with open_cluster(inventory_path) as (inv, pool):
                removed = serve.stop(inv, pool)
            return emit(output, True, {"cluster": inv.cluster, "removed": removed}, render_serve_stop)
        if keys is not None:
            return _keys_action(output, keys, key_name, max_requests, max_tokens, inventory_path)
        if key_name is not None:
            raise UsageError(f"unexpected argument {key_name!r}", "a key's name goes with --keys add/revoke NAME")
        if not model_path:
            raise UsageError(
                "serve needs --model-path DIR (or --stop)", "e.g. raycluster serve --model-path ./my-llama"
            )
        if dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise UsageError(
                f"--dtype {dtype!r} is not one of auto, float32, bfloat16, float16", "e.g. --dtype bfloat16"
            )
        if links not in ("direct", "ray"):
            raise UsageError(f"--links {links!r} is not one of direct, ray", "e.g. --links ray")
        options = serve.ServeOptions(
            model_path=model_path,
            port=port,
            stages=stages,
            slots=slots,
            max_seq=max_seq,
            model_id=model_id,
            timeout_s=timeout,
            dtype=dtype,
            image_steps=image_steps,
            image_max_steps=image_max_steps,
            image_max_pixels=image_max_pixels,
            rebalance_period_s=rebalance_period,
            steps_in_flight=steps_in_flight,
            links=links,
            api_key_file=api_key_file,
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_self_signed=tls_self_signed,
            key_max_requests=key_max_requests,
            key_max_tokens=key_max_tokens,
        )
        with open_cluster(inventory_path) as (inv, pool), output.live_progress() as progress:
            result = serve.serve(inv, pool, options, progress)
        return emit(output, True, {"cluster": inv.cluster, **result.to_dict()}, render_serve)

    execute(json_mode, debug, action)


def _keys_action(
    output: Output,
    action: str,
    name: str | None,
    max_requests: int | None,
    max_tokens: int | None,
    inventory_path: Any,
) -> int:
    """`serve --keys add NAME | revoke NAME | list`: the service's keys, changed on the head without a restart."""
    from raycluster_cli.render.operate import render_serve_keys
    from raycluster_cli.verbs import serve_keys

    if action not in ("add", "revoke", "list"):
        raise UsageError(
            f"--keys {action!r} is not one of add, revoke, list", "e.g. raycluster serve --keys add team-a"
        )
    if action != "list" and not name:
        raise UsageError(f"--keys {action} needs the key's name", f"e.g. raycluster serve --keys {action} team-a")
    if (max_requests or max_tokens) and action != "add":
        raise UsageError(
            "--max-requests and --max-tokens go with --keys add", "e.g. --keys add team-a --max-requests 8"
        )
    with open_cluster(inventory_path) as (inv, pool):
        if action == "add":
            change = serve_keys.add_key(inv, pool, str(name), max_requests, max_tokens)
        elif action == "revoke":
            change = serve_keys.revoke_key(inv, pool, str(name))
        else:
            change = serve_keys.list_keys(inv, pool)
    return emit(output, True, {"cluster": inv.cluster, **change.to_dict()}, render_serve_keys)
