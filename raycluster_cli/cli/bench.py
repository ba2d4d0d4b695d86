"""`bench`: its flags are BenchOptions' fields (the same model the driver in the head's container validates)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from raycluster_cli.bench.options import BenchOptions, ValidationError, flag_of
from raycluster_cli.cli.bench_serve import SERVE_FLAGS, check_flags, serve_bench_action
from raycluster_cli.cli.common import DebugOpt, InventoryOpt, JsonOpt, emit, execute, open_cluster
from raycluster_cli.errors import ExitCode, UsageError
from raycluster_cli.render.base import (
    Output,
)
from raycluster_cli.schema import SCHEMA_VERSION


def _flag_decl(name: str, annotation: Any) -> str:
    """``--name``, and for a switch ``--name/--no-name``."""
    flag = flag_of(name)
    return f"{flag}/--no-{flag[2:]}" if annotation is bool else flag


def _bench_parameters() -> list[inspect.Parameter]:
    """`bench`'s flags, one per field of BenchOptions (name, default, help), then the CLI's own."""
    params = [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            default=spec.default,
            annotation=Annotated[
                spec.annotation, typer.Option(_flag_decl(name, spec.annotation), help=spec.description)
            ],
        )
        for name, spec in BenchOptions.model_fields.items()
    ]
    own: dict[str, tuple[Any, Any]] = {
        "inventory_path": (InventoryOpt, None),
        "network_check": (
            Annotated[bool, typer.Option(help="measure latency, bandwidth and MTU head ↔ each worker first")],
            True,
        ),
        "timeout": (Annotated[float, typer.Option(help="seconds the whole benchmark may take")], 1800.0),
        "save_result": (Annotated[Path | None, typer.Option(help="also write the JSON result to this file")], None),
        "save_svg": (
            Annotated[Path | None, typer.Option(help="also save the report (T_i chart, sweep curves) as SVG")],
            None,
        ),
        "json_mode": (JsonOpt, False),
        "debug": (DebugOpt, False),
        **SERVE_FLAGS,
    }
    kind = inspect.Parameter.KEYWORD_ONLY
    return params + [inspect.Parameter(n, kind, default=d, annotation=a) for n, (a, d) in own.items()]


def _bench_options(values: dict[str, Any]) -> BenchOptions:
    """The validated options; a bad value is a usage error naming its flag."""
    given = {k: v for k, v in values.items() if v != BenchOptions.model_fields[k].default}
    try:
        return BenchOptions(**given)
    except ValidationError as exc:
        first = exc.errors()[0]
        message = str(first["msg"]).removeprefix("Value error, ")
        if not first["loc"]:  # a rule between flags: its message names them
            raise UsageError(message, "see `raycluster bench --help`") from None
        flag = flag_of(str(first["loc"][0]))
        text = f"{flag} {message}" if message.startswith("'") else f"{flag} {first['input']!r}: {message}"
        raise UsageError(text, f"see `raycluster bench --help` for what {flag} takes") from None


def bench_command(**values: Any) -> None:
    """Pipeline-parallel inference across the nodes: throughput, latency and each node's busy time.

    With no flags the run is sized to the cluster: enough layers that every node gets a share
    proportional to its measured speed, and about --duration-s of counted work. --quick: a short smoke run.
    --serve: the running service instead, as its clients see it (Poisson rates and a saturation run; exit 1 when
    a request failed)."""
    own = {k: values.pop(k) for k in list(values) if k not in BenchOptions.model_fields}

    def action(output: Output) -> int:
        check_flags(values, own)
        if own["serve"]:
            return serve_bench_action(output, values, own)
        from raycluster_cli.checks.network import measure_network
        from raycluster_cli.render.bench import bench_progress, render_bench, save_svg
        from raycluster_cli.verbs.bench import BenchFailed, place_bench_model, run_bench

        options = _bench_options(values)
        with open_cluster(own["inventory_path"]) as (inv, pool):
            options, copies = place_bench_model(inv, pool, options, output.progress())
            network = measure_network(inv, pool, output.progress(), seconds=1.0) if own["network_check"] else []
            output.progress()(f"running the benchmark on {len(inv.hosts)} node(s)")
            try:
                with bench_progress(output) as progress:
                    document = run_bench(inv, pool, options, timeout_s=own["timeout"], progress=progress)
            except BenchFailed as exc:
                if not exc.failure:
                    raise
                output.error(exc.message, exc.hint)
                if output.json_mode:
                    output.document(
                        False, {"error": {"message": exc.message, "hint": exc.hint}, "failure": exc.failure}
                    )
                return ExitCode.FAILED
        document["network"] = [r.to_dict() for r in network]
        if copies:
            document["model_copies"] = copies
        document.pop("schema_version", None)
        ok = bool(document.pop("ok", True))
        if own["save_result"]:
            own["save_result"].write_text(
                json.dumps({"schema_version": SCHEMA_VERSION, "ok": ok, **document}, indent=2) + "\n"
            )
        if own["save_svg"]:
            save_svg(document, own["save_svg"])
        return emit(output, ok, document, render_bench)

    execute(own["json_mode"], own["debug"], action)


bench_command.__signature__ = inspect.Signature(_bench_parameters())  # type: ignore[attr-defined]
