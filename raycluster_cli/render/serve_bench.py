"""`bench --serve`'s report: one row per run (load, counts, throughput, latency percentiles, balance), each node's
T_i in the saturation run (the last run otherwise), and the SVG of latency against offered load.

The SVG is drawn here as plain SVG elements (no plotting library in the operator install): two panels, TTFT and
TPOT, each with a p50 and a p99 line over the Poisson rates, and the saturation run as a square at the request
rate it reached. Every point is a ``<circle>`` (or ``<rect>``) of class ``point`` with its series and run as
data attributes, so tests and other tools read the figures back.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from rich.table import Table

from raycluster_cli.render.base import Output
from raycluster_cli.render.bench import bar_chart
from raycluster_cli.render.text import remote_text

SVG_NS = "http://www.w3.org/2000/svg"  # SVG's XML namespace: a name, never fetched (browsers need it)
WIDTH, PANEL_H, MARGIN = 760, 260, 60
COLOURS = {"p50": "#1f77b4", "p99": "#d62728"}


def _ms(value: Any) -> str:
    return "-" if value is None else f"{1000 * float(value):.1f}"


def _load(run: dict[str, Any]) -> str:
    if run["kind"] == "poisson":
        return f"Poisson {run['rate']:g}/s"
    return f"{run.get('concurrency')} at once"


def _pair(run: dict[str, Any], key: str) -> str:
    values = run.get("latency_s", {}).get(key) or {}
    return f"{_ms(values.get('p50'))} / {_ms(values.get('p99'))}"


def _sampling(sampling: Any) -> str:
    """``greedy``, or the sampling every request asked for (``temperature 0.8, top_p 0.95``)."""
    if not isinstance(sampling, dict) or not sampling.get("temperature"):
        return "greedy"
    return ", ".join(f"{remote_text(k)} {remote_text(v)}" for k, v in sampling.items())


def render_serve_bench(output: Output, body: dict[str, Any]) -> None:
    work = body.get("workload", {})
    if work.get("kind") == "image":
        _render_images(output, body)
        return
    output.line(
        f"service {remote_text(str(body.get('model')))} at {remote_text(str(body.get('url')))}: "
        f"{remote_text(work.get('requests_per_run'))} requests per run, prompts "
        f"{remote_text(work.get('prompt_tokens'))} tokens, outputs {remote_text(work.get('output_tokens'))} tokens "
        f"(ignore_eos), seed {remote_text(work.get('seed'))}, {_sampling(work.get('sampling'))}"
    )
    runs = body.get("runs", [])
    counts = Table(title="throughput", title_justify="left")
    latency = Table(title="latency in ms (p50 / p99)", title_justify="left")
    for table in (counts, latency):
        table.add_column("load", no_wrap=True)
    for column in ("done", "failed", "req/s", "out tok/s", "imbalance"):
        counts.add_column(column, justify="right")
    for column in ("TTFT", "TPOT", "ITL", "e2e"):
        latency.add_column(column, justify="right", no_wrap=True)
    for run in runs:
        load = remote_text(_load(run)) + (" [yellow]*[/yellow]" if run.get("interrupted") else "")
        counts.add_row(
            load,
            remote_text(run["completed"]),
            remote_text(run["failed"]),
            f"{run['requests_per_s']:.2f}",
            f"{run['output_tokens_per_s']:.1f}",
            "-" if run.get("imbalance") is None else f"{run['imbalance']:.3f}",
        )
        latency.add_row(load, *(_pair(run, key) for key in ("ttft", "tpot", "itl", "e2e")))
    output.out.print(counts)
    output.out.print(latency)

    def row(s: dict[str, Any], several: bool) -> tuple[str, float, str]:
        label = (f"#{s['pipeline']} " if several else "") + f"{s['node_ip']} ({s.get('blocks')} blocks)"
        share = s.get("node_cpu_share")
        node = f", its node {share:.0%} of its CPU quota" if share is not None else ""
        got = s.get("forward_cpu_per_busy_s")
        cpu = f", {got:.2f} CPU-s per busy s" if got is not None else ""
        return label, s["busy_s"], f"{s['busy_s']:.3f}s, {s['steps']} steps{node}{cpu}"

    _errors_and_busy_time(
        output, runs, row, lambda shown: f", the slowest stage busy {shown['of_ceiling']:.0%} of the run"
    )
    if body.get("interrupted"):
        output.line("[yellow]* interrupted: the requests it finished; the runs above are what was measured[/yellow]")


def _errors_and_busy_time(
    output: Output,
    runs: list[dict[str, Any]],
    row: Callable[[dict[str, Any], bool], tuple[str, float, str]],
    more: Callable[[dict[str, Any]], str],
) -> None:
    """Each run's errors, then the T_i chart and the balance of the saturation run (else the last measured):
    text and image services alike, `row` making a stage's bar (its label, busy seconds, detail)."""
    for run in runs:
        for error in run.get("errors", []):
            output.line(f"[yellow]{remote_text(_load(run))}: {remote_text(error)}[/yellow]")
    measured = [r for r in runs if r.get("stages")]
    if not measured:
        return
    shown = next((r for r in measured if r["kind"] == "saturation"), measured[-1])
    several = len({s.get("pipeline") for s in shown["stages"]}) > 1
    rows = [row(s, several) for s in shown["stages"]]
    bar_chart(output, f"busy time T_i per node ({remote_text(_load(shown))}, wall {shown['wall_s']:.2f}s):", rows)
    if shown.get("t_max_minus_t_min_s") is not None:
        output.line(
            f"T_max − T_min = {shown['t_max_minus_t_min_s']:.3f}s, imbalance {shown['imbalance']:.3f}, "
            f"utilisation {shown['utilisation']:.2f}{more(shown)}"
        )
    for index, anatomy in sorted((shown.get("anatomy") or {}).items()):
        output.line(remote_text(_anatomy_line(index if several else None, anatomy)))
    collections = shown.get("ingress_gc")
    if collections and collections["full_collections"]:
        output.line(
            f"the ingress paused {remote_text(collections['full_collections'])} time(s) for full garbage collections, "
            f"{collections['seconds'] * 1e3:.0f} ms in all (the largest of its recent ones {_ms_or(collections['max_ms'])})"
        )
    front = shown.get("front_end") or {}
    if front.get("ingress_ms_per_token") is not None:
        proxy = front.get("proxy_ms_per_token")
        output.line(
            f"the front end's CPU per output token: the ingress {front['ingress_ms_per_token']:.2f} ms"
            + (f", Serve's proxy {proxy:.2f} ms" if proxy is not None else "")
            + " (on the head, beside its stage)"
        )
    for run in runs:
        changed = run.get("pipelines_changed")
        if changed:
            output.line(
                f"[yellow]{remote_text(_load(run))}: pipelines changed during the run (a re-split or a failover): "
                f"retired {remote_text(changed['retired'])}, new {remote_text(changed['new'])}; the retired ones' work is not in T_i[/yellow]"
            )


def _ms_or(value: Any) -> str:
    return "?" if value is None else f"{value:.1f} ms"


def _anatomy_line(pipeline: str | None, anatomy: dict[str, Any]) -> str:
    """A step's time, median ms over the last steps: round trip, then per stage compute+queued+link (idle share)."""

    def ms(value: Any) -> str:
        return "-" if value is None else f"{float(value):.1f}"

    lag = anatomy.get("loop_lag_ms") or {}

    parts = [
        f"s{i} {ms(s.get('compute_ms'))}+{ms(s.get('queued_ms'))}q+{ms(s.get('link_ms'))}l"
        + (f" (idle {s['idle_share']:.0%})" if s.get("idle_share") is not None else "")
        for i, s in enumerate(anatomy.get("stages", []))
    ]
    return (
        (f"#{pipeline} " if pipeline is not None else "")
        + f"a step (median ms over {anatomy.get('steps')}): round trip {ms(anatomy.get('round_trip_ms'))}, "
        + f"{anatomy.get('in_flight')} in flight; compute+queued+link: {', '.join(parts)}; "
        + f"back {ms(anatomy.get('return_link_ms'))}, engine's loop {ms(anatomy.get('engine_wait_ms'))}"
        + f" (lag p50 {ms(lag.get('p50'))}, p90 {ms(lag.get('p90'))}), engine {ms(anatomy.get('engine_ms'))}"
    )


def _seconds(run: dict[str, Any]) -> list[str]:
    values = run.get("latency_s", {}).get("e2e") or {}
    return ["-" if values.get(q) is None else f"{values[q]:.2f}" for q in ("p50", "p90", "p99")]


def _render_images(output: Output, body: dict[str, Any]) -> None:
    """An image service's runs: images/s, seconds per image p50/p90/p99, each replica's share, each node's T_i."""
    work = body.get("workload", {})
    output.line(
        f"image service {remote_text(str(body.get('model')))} at {remote_text(str(body.get('url')))}: "
        f"{remote_text(work.get('requests_per_run'))} images per run, {remote_text(work.get('size'))} px, "
        f"{remote_text(work.get('steps'))} steps, {remote_text(work.get('replicas'))} replica(s), "
        f"seed {remote_text(work.get('seed'))}"
    )
    runs = body.get("runs", [])
    table = Table(title="images (seconds per image: p50 / p90 / p99)", title_justify="left")
    table.add_column("load", no_wrap=True)
    for column in ("done", "failed", "images/s", "p50 s", "p90 s", "p99 s", "per replica", "imbalance"):
        table.add_column(column, justify="right")
    for run in runs:
        share = remote_text("/".join(str(r["images"]) for r in run.get("replicas", [])))
        table.add_row(
            remote_text(_load(run)) + (" [yellow]*[/yellow]" if run.get("interrupted") else ""),
            remote_text(run["completed"]), remote_text(run["failed"]), f"{run['images_per_s']:.2f}", *_seconds(run), share or "-",
            "-" if run.get("imbalance") is None else f"{run['imbalance']:.3f}",
        )  # fmt: skip
    output.out.print(table)

    def row(s: dict[str, Any], several: bool) -> tuple[str, float, str]:
        return f"{s['node_ip']} ({'+'.join(s['parts'])})", s["busy_s"], f"{s['busy_s']:.3f}s, {s['calls']} calls"

    _errors_and_busy_time(output, runs, row, lambda shown: "")
    if body.get("interrupted"):
        output.line("[yellow]* interrupted: the images it finished; the runs above are what was measured[/yellow]")


def _scale(values: list[float], low_px: float, high_px: float) -> tuple[float, Any]:
    top = max(values, default=0.0) or 1.0

    def to_px(value: float) -> float:
        return low_px + (high_px - low_px) * value / top

    return top, to_px


def _panel(key: str, title: str, runs: list[dict[str, Any]], top_px: float) -> list[str]:
    """One chart: ``key``'s p50 and p99 (ms) against the offered request rate."""
    poisson = [r for r in runs if r["kind"] == "poisson"]
    saturated = [r for r in runs if r["kind"] == "saturation"]
    xs = [float(r["rate"]) for r in poisson] + [float(r["requests_per_s"]) for r in saturated]
    ys = [1000 * float(v) for r in runs for q in ("p50", "p99") if (v := (r["latency_s"][key] or {}).get(q))]
    bottom = top_px + PANEL_H - 40
    x_top, x_px = _scale(xs, MARGIN, WIDTH - 30)
    y_top, y_px = _scale(ys, bottom, top_px + 20)
    parts = [
        f'<text x="{MARGIN}" y="{top_px + 12}" font-size="14">{escape(title)}</text>',
        f'<line x1="{MARGIN}" y1="{bottom}" x2="{WIDTH - 30}" y2="{bottom}" stroke="#444"/>',
        f'<line x1="{MARGIN}" y1="{bottom}" x2="{MARGIN}" y2="{top_px + 20}" stroke="#444"/>',
        f'<text x="{WIDTH - 30}" y="{bottom + 28}" font-size="11" text-anchor="end">'
        f"offered load (requests/s), max {x_top:.3g}</text>",
        f'<text x="{MARGIN - 6}" y="{top_px + 24}" font-size="11" text-anchor="end">{y_top:.3g} ms</text>',
        f'<text x="{MARGIN - 6}" y="{bottom}" font-size="11" text-anchor="end">0</text>',
    ]
    for q, colour in COLOURS.items():
        points = [
            (float(r["rate"]), float(v)) for r in poisson if (v := (r["latency_s"][key] or {}).get(q)) is not None
        ]
        drawn = [(x_px(rate), y_px(1000 * value)) for rate, value in points]
        if len(drawn) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in drawn)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}"/>')
        for (rate, value), (x, y) in zip(points, drawn, strict=True):
            parts.append(
                f'<circle class="point" data-series="{key}-{q}" data-rate="{rate:g}" data-ms="{1000 * value:.3f}" '
                f'cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{colour}"/>'
            )
        for run in saturated:
            found = (run["latency_s"][key] or {}).get(q)
            if found is not None:
                value = float(found)
                x, y = x_px(float(run["requests_per_s"])), y_px(1000 * value)
                parts.append(
                    f'<rect class="point saturation" data-series="{key}-{q}" data-rate="saturation" '
                    f'data-ms="{1000 * value:.3f}" x="{x - 4:.1f}" y="{y - 4:.1f}" width="8" height="8" '
                    f'fill="none" stroke="{colour}"/>'
                )
        legend_y = top_px + 12 + (16 if q == "p99" else 0)
        parts.append(
            f'<text x="{WIDTH - 30}" y="{legend_y}" font-size="11" text-anchor="end" fill="{colour}">'
            f"{key.upper()} {q} (circles: Poisson rates; square: saturation)</text>"
        )
    return parts


def save_serve_svg(body: dict[str, Any], path: Path) -> None:
    """Latency (TTFT and TPOT, p50 and p99) against offered load, as an SVG file a browser opens."""
    runs = [r for r in body.get("runs", []) if r.get("completed")]
    height = 2 * PANEL_H + 30
    parts = [
        f'<svg xmlns="{SVG_NS}" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="{MARGIN}" y="18" font-size="15">raycluster bench --serve: '
        f"{escape(str(body.get('model', '')))}</text>",
    ]
    if body.get("workload", {}).get("kind") == "image":
        parts += _panel("e2e", "time per image (ms)", runs, 30)
    else:
        parts += _panel("ttft", "time to first token (ms)", runs, 30)
        parts += _panel("tpot", "time per output token (ms)", runs, 30 + PANEL_H)
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")
