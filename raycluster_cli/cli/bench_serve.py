"""`bench --serve`: the flags of the serving benchmark (verbs/serve_bench.py) and its action.

`bench` measures a pipeline run it starts itself; with `--serve` it measures the service `serve` left running,
from this machine, as clients see it. `--requests` and `--seed` mean the same in both; the pipeline run's other
flags have no meaning here and are refused, as are these flags without `--serve`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from raycluster_cli.bench.options import BenchOptions, flag_of
from raycluster_cli.cli.common import open_cluster
from raycluster_cli.config import inventory
from raycluster_cli.errors import ExitCode, UsageError
from raycluster_cli.render.base import Output
from raycluster_cli.schema import SCHEMA_VERSION

PANEL = "serving benchmark (--serve)"
SHARED = {"requests", "seed"}  # BenchOptions' fields that --serve uses too
DEFAULT_REQUESTS = 32


def _opt(help_text: str, *decls: str) -> Any:
    return typer.Option(*decls, help=help_text, rich_help_panel=PANEL)


SERVE_FLAGS: dict[str, tuple[Any, Any]] = {
    "serve": (
        Annotated[
            bool, _opt("benchmark the running service (`serve`) from this machine, as its clients see it", "--serve")
        ],
        False,
    ),
    "rates": (Annotated[str, _opt('Poisson arrival rates to run, requests/s: R[,R...] ("": none)')], "0.5,1,2"),
    "saturation": (Annotated[bool, _opt("also a run with every request sent at once")], True),
    "concurrency": (
        Annotated[int, _opt("the saturation run's requests in flight at most (0: all)", "--concurrency")],
        0,
    ),
    "prompt_tokens": (
        Annotated[str, _opt("prompt tokens per request, N or LOW:HIGH (default: 1/16..1/4 of the context)")],
        "",
    ),
    "output_tokens": (
        Annotated[str, _opt("tokens generated per request (max_tokens, EOS ignored), N or LOW:HIGH")],
        "",
    ),
    "temperature": (Annotated[float, _opt("sampling temperature of every request (0: greedy)")], 0.0),
    "top_p": (Annotated[float, _opt("nucleus sampling: the top-p of every request (1: off)")], 1.0),
    "url": (Annotated[str, _opt("the service's base URL (default: the one `serve` recorded on the head)")], ""),
    "request_timeout": (Annotated[float, _opt("seconds one request may take")], 300.0),
    "api_key_file": (
        Annotated[str, _opt("a file holding the service's key (default: the one `serve` made on this machine)")],
        "",
    ),
    "ca_file": (
        Annotated[str, _opt("an https service's certificate (PEM) to verify it with (default: the one `serve` used)")],
        "",
    ),
}


def check_flags(values: dict[str, Any], own: dict[str, Any]) -> None:
    """Pipeline-run flags with --serve, or --serve's flags without it: one usage error naming the flag."""
    if own["serve"]:
        for name, value in values.items():
            if name not in SHARED and value != BenchOptions.model_fields[name].default:
                raise UsageError(f"{flag_of(name)} is a pipeline-run flag; --serve does not use it", "drop it")
        return
    for name, (_, default) in SERVE_FLAGS.items():
        if name != "serve" and own[name] != default:
            raise UsageError(f"{flag_of(name)} needs --serve", f"raycluster bench --serve {flag_of(name)} ...")


def _plan(values: dict[str, Any], own: dict[str, Any]) -> Any:
    from raycluster_cli.verbs.serve_bench import LoadPlan
    from raycluster_cli.verbs.serve_load import parse_range, parse_rates

    try:
        rates = parse_rates(own["rates"])
        prompt = parse_range(own["prompt_tokens"], "--prompt-tokens") if own["prompt_tokens"] else None
        output = parse_range(own["output_tokens"], "--output-tokens") if own["output_tokens"] else None
    except ValueError as exc:
        raise UsageError(str(exc), "see `raycluster bench --help`") from None
    if own["concurrency"] < 0:
        raise UsageError(f"--concurrency {own['concurrency']} must be >= 0", "0 sends every request at once")
    if own["temperature"] < 0:
        raise UsageError(f"--temperature {own['temperature']:g} must be >= 0", "0 is greedy, e.g. 0.8 samples")
    if not 0 < own["top_p"] <= 1:
        raise UsageError(f"--top-p {own['top_p']:g} must be in (0, 1]", "e.g. --top-p 0.95; 1 turns it off")
    if not rates and not own["saturation"]:
        raise UsageError("--rates '' and --no-saturation leave nothing to run", "give --rates or drop --no-saturation")
    requests = values["requests"] or DEFAULT_REQUESTS
    return LoadPlan(
        tuple(rates),
        requests,
        own["saturation"],
        own["concurrency"],
        prompt,
        output,
        values["seed"],
        own["request_timeout"],
        own["temperature"],
        own["top_p"],
    )


def _write(body: dict[str, Any], ok: bool, own: dict[str, Any]) -> None:
    from raycluster_cli.render.serve_bench import save_serve_svg

    if own["save_result"]:
        document = {"schema_version": SCHEMA_VERSION, "ok": ok, **body}
        Path(own["save_result"]).write_text(json.dumps(document, indent=2) + "\n")
    if own["save_svg"]:
        save_serve_svg(body, Path(own["save_svg"]))


def serve_bench_action(output: Output, values: dict[str, Any], own: dict[str, Any]) -> int:
    """Find the service, run the load, render; Ctrl-C: exit 130 with the runs measured so far."""
    from raycluster_cli.render.serve_bench import render_serve_bench
    from raycluster_cli.verbs import serve_bench
    from raycluster_cli.verbs.serve import service_status

    plan = _plan(values, own)
    if own["url"]:  # no host is asked: the inventory only names the cluster, whose service key is on this machine
        inv = inventory.load(own["inventory_path"]).inventory
        target = serve_bench.target_of(inv, None, own["url"], own["api_key_file"], own["ca_file"])
    else:
        with open_cluster(own["inventory_path"]) as (inv, pool):
            target = serve_bench.target_of(inv, service_status(inv, pool), "", own["api_key_file"], own["ca_file"])
    report = serve_bench.ServeBenchReport()
    try:
        serve_bench.run_blocking(target, plan, report, output.progress(), timeout_s=own["timeout"])
    except KeyboardInterrupt:
        body = report.to_dict(interrupted=True)
        _write(body, False, own)
        output.error("interrupted", "the report holds the runs measured before the interrupt")
        if output.json_mode:
            output.document(False, body)
        else:
            render_serve_bench(output, body)
        return ExitCode.INTERRUPTED
    body = report.to_dict()
    ok = all(run["failed"] == 0 for run in body["runs"])
    _write(body, ok, own)
    if output.json_mode:
        output.document(ok, body)
    else:
        render_serve_bench(output, body)
        if not ok:
            output.error("some requests failed", "the errors are listed above; raycluster status shows the service")
    return ExitCode.OK if ok else ExitCode.FAILED
