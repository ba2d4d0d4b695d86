"""`serve`: the balanced pipeline as an OpenAI-compatible service on the cluster (verbs/serve.py, serve/ in the
node image); `serve --stop` removes it.  Its flags are ServeOptions' fields (serve/options.py: the same model the
launcher in the head's container validates)."""

from __future__ import annotations

import inspect
from typing import Annotated, Any

import typer

from raycluster_cli.cli.common import DebugOpt, InventoryOpt, JsonOpt, emit, execute, open_cluster
from raycluster_cli.errors import UsageError
from raycluster_cli.render.base import Output
from raycluster_cli.serve.options import ServeOptions, ValidationError, flag_of, problem


def _flag(name: str, annotation: Any) -> Any:
    """The Typer option of one of ServeOptions' fields: its flag (a switch has no --no- form) and its help."""
    return Annotated[annotation, typer.Option(flag_of(name), help=ServeOptions.model_fields[name].description)]


def _serve_parameters() -> list[inspect.Parameter]:
    """`serve`'s flags: one per field of ServeOptions (name, default, help), then the key verbs' and the CLI's own."""
    kind = inspect.Parameter.KEYWORD_ONLY
    fields = [
        inspect.Parameter(name, kind, default=spec.default, annotation=_flag(name, spec.annotation))
        for name, spec in ServeOptions.model_fields.items()
    ]
    own: dict[str, tuple[Any, Any]] = {
        "keys": (
            Annotated[
                str | None,
                typer.Option(
                    "--keys",
                    help="the service's API keys instead: add NAME (a new key, its file printed, in effect at once),"
                    " revoke NAME, list",
                ),
            ],
            None,
        ),
        "key_name": (
            Annotated[str | None, typer.Argument(metavar="[NAME]", help="the key's name for --keys add/revoke")],
            None,
        ),
        "max_requests": (
            Annotated[int | None, typer.Option(min=1, help="--keys add: this key's requests in flight at most")],
            None,
        ),
        "max_tokens": (
            Annotated[int | None, typer.Option(min=1, help="--keys add: this key's tokens in flight at most")],
            None,
        ),
        "stop": (Annotated[bool, typer.Option("--stop", help="remove the service instead")], False),
        "inventory_path": (InventoryOpt, None),
        "json_mode": (JsonOpt, False),
        "debug": (DebugOpt, False),
    }
    return fields + [inspect.Parameter(n, kind, default=d, annotation=a) for n, (a, d) in own.items()]


def serve_options(values: dict[str, Any]) -> ServeOptions:
    """The validated options from `serve`'s flags; a bad value is one line naming its flag, and the fix."""
    if not values.get("model_path"):
        raise UsageError("serve needs --model-path DIR (or --stop)", "e.g. raycluster serve --model-path ./my-llama")
    given = {k: v for k, v in values.items() if v != ServeOptions.model_fields[k].default}
    try:
        return ServeOptions(**given)
    except ValidationError as exc:
        message, flag = problem(exc)
        hint = f"see `raycluster serve --help` for what {flag} takes" if flag else "see `raycluster serve --help`"
        raise UsageError(message, hint) from None


def serve_command(**values: Any) -> None:
    """Serve a model across the cluster as an OpenAI-compatible API (/v1/completions, /v1/chat/completions; a
    diffusers checkpoint, with model_index.json: /v1/images/generations, PNGs as b64_json).

    Returns once a real generation went through every stage; the service keeps running after this command
    (a second `serve` replaces it; `serve --stop` removes it; `status` shows it). Clients use the service's own
    API keys (`--keys add NAME`), never the cluster's Ray token. Exit 0: serving (or removed); 1: it did not
    start; 2: bad flags or inventory."""
    own = {k: values.pop(k) for k in list(values) if k not in ServeOptions.model_fields}

    def action(output: Output) -> int:
        from raycluster_cli.render.operate import render_serve, render_serve_stop
        from raycluster_cli.verbs import serve

        if own["stop"]:
            with open_cluster(own["inventory_path"]) as (inv, pool):
                removed = serve.stop(inv, pool)
            return emit(output, True, {"cluster": inv.cluster, "removed": removed}, render_serve_stop)
        if own["keys"] is not None:
            return _keys_action(
                output, own["keys"], own["key_name"], own["max_requests"], own["max_tokens"], own["inventory_path"]
            )
        if own["key_name"] is not None:
            raise UsageError(
                f"unexpected argument {own['key_name']!r}", "a key's name goes with --keys add/revoke NAME"
            )
        options = serve_options(values)
        with open_cluster(own["inventory_path"]) as (inv, pool), output.live_progress() as progress:
            result = serve.serve(inv, pool, options, progress)
        return emit(output, True, {"cluster": inv.cluster, **result.to_dict()}, render_serve)

    execute(own["json_mode"], own["debug"], action)


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


serve_command.__signature__ = inspect.Signature(_serve_parameters())  # type: ignore[attr-defined]
