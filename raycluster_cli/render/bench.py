"""Rendering of `bench`: its live progress line, the result (tables, bar charts), and the SVG export."""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from raycluster_cli.render.base import Output
from raycluster_cli.render.text import remote_text, terminal_safe
from raycluster_cli.verbs.bench import BenchEvent

BAR_WIDTH = 30
LINE_EVERY_S = 5.0  # without a terminal, a count line at most this often (phase changes always)


def _secs(value: Any, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _ratio(value: Any) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _spread(value: Any) -> str:
    return "" if value is None else f" ±{100 * value / 2:.0f}%"


def event_text(event: BenchEvent) -> str:
    """``pilot 2/3: requests 412/1000`` — the phase and, when it has one, its count."""
    if event.step == "node lost":
        where = event.extra.get("host") or event.extra.get("node_ip")
        return (
            f"{event.phase}: node {where} (stage {event.extra.get('stage')}) lost; "
            f"{event.extra.get('retried')} request(s) retried on another replica ({event.extra.get('error')})"
        )
    if event.total is not None:
        return f"{event.phase}: {event.step or 'requests'} {event.done}/{event.total}"
    return event.phase


@contextmanager
def bench_progress(output: Output) -> Iterator[Callable[[BenchEvent], None]]:
    """A live line in a terminal; otherwise a line on stderr per phase (and per few seconds of counting)."""
    live = Live(Text(""), console=output.err, transient=True) if output.err.is_terminal else None
    last_phase = [""]
    last_at = [0.0]
    last_text = [""]

    def sink(event: BenchEvent) -> None:
        text = event_text(event)
        if event.step == "node lost":
            output.warning(text)
            return
        if live is not None:
            if not live.is_started:
                live.start()
            live.update(Text(f"· {terminal_safe(text)}", style="dim"))
            return
        now = time.monotonic()
        due = event.phase != last_phase[0] or now - last_at[0] >= LINE_EVERY_S or event.done == event.total
        if due and text != last_text[0]:
            last_phase[0], last_at[0], last_text[0] = event.phase, now, text
            output.progress()(text)

    try:
        yield sink
    finally:
        if live is not None:
            live.stop()


def _host(stage: dict[str, Any]) -> str:
    return str(stage.get("host", stage.get("node_ip", "?")))


def _stage_label(stage: dict[str, Any], multi: bool) -> str:
    """Stages by host; the replica only when there are several."""
    return f"{_host(stage)} r{stage.get('replica', 0)}" if multi else _host(stage)


def _stage_table(output: Output, stages: list[dict[str, Any]], multi: bool) -> None:
    table = Table(title="pipeline stages (one per node)", title_justify="left")
    columns = ["host", "stage", "layers", "busy T_i (s)", "CPU (s)", "idle (s)", "predicted (s)"]
    for column in columns:
        table.add_column(column, justify="right" if "(s)" in column else "left")
    for stage in stages:
        extra = "+emb" if stage.get("has_embedding") else ""
        extra += "+head" if stage.get("has_head") else ""
        where = f"{stage.get('replica', 0)}.{stage['index']}" if multi else str(stage["index"])
        table.add_row(
            remote_text(_host(stage)),
            remote_text(where),
            remote_text(f"{stage['layers']}{extra}"),
            f"{stage['busy_s']:.3f}",
            _secs(stage.get("cpu_s")),
            _secs(stage.get("idle_s")),
            _secs(stage.get("predicted_s")),
        )
    output.out.print(table)


def bar_chart(output: Output, title: str, rows: list[tuple[str, float, str]]) -> None:
    """A horizontal bar per row (label, value, text after the bar), scaled to the largest value."""
    output.line(title)
    largest = max((value for _, value, _ in rows), default=0.0) or 1.0
    width = max((len(label) for label, _, _ in rows), default=0)
    for label, value, after in rows:
        bar = "█" * max(1, round(BAR_WIDTH * value / largest))
        output.line(f"  {remote_text(label):<{width}} [cyan]{bar}[/cyan] {remote_text(after)}")


def _summary(output: Output, body: dict[str, Any], stages: list[dict[str, Any]]) -> None:
    config = body.get("config", {})
    load = f"Poisson {remote_text(config.get('rate'))} req/s" if config.get("mode") == "poisson" else "offline"
    quota = body.get("imbalance_capacity") is not None and any(s.get("cpu_quota") for s in stages)
    output.line(
        f"{body['tokens_per_s']:.1f} tokens/s{_spread(body.get('tokens_per_s_spread'))}, "
        f"{body.get('requests_per_s', 0):.2f} requests/s "
        f"({remote_text(body.get('completed', '?'))}/{remote_text(body.get('requests', '?'))} requests in {body.get('wall_s', 0):.1f}s, {load}); "
        f"T_max − T_min = {body.get('t_max_minus_t_min_s', 0):.3f}s, imbalance {body['imbalance']:.3f}"
        + (f" (against CPU quotas {body['imbalance_capacity']:.3f})" if quota else "")
        + f", utilisation {body.get('utilisation', 0):.2f}"
    )
    if body.get("tokens_per_s_spread") is not None:
        output.line("[dim]± is half the spread (max − min)/mean of tokens/s over the run's steady-state windows[/dim]")


def _latency(output: Output, latency: dict[str, Any]) -> None:
    if not latency:
        return
    lat = Table(title="latency (s, from arrival)", title_justify="left")
    for column in ("", "p50", "p90", "p99"):
        lat.add_column(column, justify="right")
    for key, label in (("ttft", "time to first token"), ("tpot", "time per output token"), ("e2e", "end to end")):
        values = latency.get(key) or {}
        lat.add_row(label, *(_secs(values.get(q), 4) for q in ("p50", "p90", "p99")))
    output.out.print(lat)


def _gap_text(gap: dict[str, Any]) -> str:
    """Where the busiest stage idled: filling, between calls, draining (older results: outside/in its span)."""
    stage = remote_text(str(gap.get("stage")))
    if gap.get("idle_fill_s") is not None:
        return (
            f" (busiest stage {stage} idle: {gap['idle_fill_s']:.2f}s filling, "
            f"{gap['idle_between_s']:.2f}s between calls, {gap['idle_drain_s']:.2f}s draining)"
        )
    if gap.get("outside_span_s") is not None:
        return (
            f" (busiest stage {stage}: {gap['outside_span_s']:.2f}s filling/draining, "
            f"{gap['idle_in_span_s']:.2f}s idle between calls)"
        )
    return ""


def _idle_line(output: Output, body: dict[str, Any]) -> None:
    """One line: each stage's idle (fill / between / drain) and how much of its CPU quota its node used."""
    items = []
    for stage in body.get("stages", []):
        if stage.get("idle_fill_s") is None:
            continue
        text = (
            f"{remote_text(_host(stage))} {stage['idle_fill_s']:.2f}/{stage['idle_between_s']:.2f}/"
            f"{stage['idle_drain_s']:.2f}s"
        )
        if stage.get("quota_used") is not None:
            text += f" (quota {stage['quota_used']:.0%} used)"
        items.append(text)
    if items:
        output.line("idle fill/between/drain: " + ", ".join(items))


def _references(output: Output, body: dict[str, Any]) -> None:
    refs = body.get("references", {})
    parts = []
    skipped = [
        f"{name}: {ref['skipped']}" for name, ref in refs.items() if isinstance(ref, dict) and ref.get("skipped")
    ]
    for name in ("even", "balanced"):
        if refs.get(name) and not refs[name].get("skipped"):
            ref = refs[name]
            parts.append(
                f"vs {name} split {_ratio(ref.get('ratio'))} "
                f"({ref['tokens_per_s']:.1f} tok/s{_spread(ref.get('tokens_per_s_spread'))})"
            )
    if refs.get("unsharded") and not refs["unsharded"].get("skipped"):
        ref = refs["unsharded"]
        parts.append(
            f"vs unsharded on {remote_text(_host(ref))} {_ratio(ref.get('ratio'))} ({ref['tokens_per_s']:.1f} tok/s)"
        )
    if refs.get("ceiling"):
        text = f"of the pipeline ceiling {_ratio(refs['ceiling'].get('ratio'))}"
        parts.append(text + _gap_text(refs["ceiling"].get("gap") or {}))
    if parts:
        output.line("references (same run): " + "; ".join(parts))
    for text in skipped:
        output.line(f"[yellow]reference skipped, {remote_text(text)}[/yellow]")
    _idle_line(output, body)
    choice = body.get("split_choice") or {}
    if choice.get("used") == "even" and body.get("config", {}).get("partition") == "balanced":
        output.line(f"[yellow]used the even split: {remote_text(str(choice.get('reason')))}[/yellow]")


def _faults(output: Output, body: dict[str, Any]) -> None:
    for lost in body.get("lost_nodes", []):
        output.line(
            f"[bold yellow]node lost:[/bold yellow] {remote_text(_host(lost))} (stage {remote_text(lost.get('stage'))}, "
            f"replica {remote_text(lost.get('replica'))}) during {remote_text(str(lost.get('phase')))}: "
            f"{remote_text(lost.get('requests_retried'))} request(s) retried on another replica; {remote_text(str(lost.get('error')))}"
        )
    if body.get("retried_requests"):
        output.line(f"retried requests in the counted run: {remote_text(body['retried_requests'])}")


def render_images(output: Output, body: dict[str, Any]) -> None:
    """An image benchmark: the placement and why, T_i per node, images/s, seconds per image, references."""
    placement = body.get("placement", {})
    output.line(f"placement: {remote_text(str(placement.get('why', '')))}")
    for index, replica in enumerate(placement.get("replicas", [])):
        held = " | ".join(
            f"{h.get('host') or h.get('node_ip')} ({'+'.join(h.get('parts', []))})" for h in replica.get("holders", [])
        )
        learned = (body.get("learned_s_per_image") or [])[index : index + 1]
        output.line(
            f"  replica {index}: {remote_text(held)}, {replica.get('s_per_image', 0):.3f} s per image calibrated"
            + (f", {learned[0]:.3f} s in the counted run" if learned else "")
        )
    nodes = body.get("nodes", [])
    bar_chart(
        output,
        "busy time T_i per node:",
        [
            (
                f"{n.get('host') or n.get('node_ip')} {'+'.join(n.get('parts', []))}",
                n["busy_s"],
                f"{n['busy_s']:.3f}s, {n.get('calls', 0)} calls",
            )
            for n in nodes
        ],
    )
    latency = body.get("latency_s") or {}
    output.line(
        f"{body.get('images_per_s', 0):.3f} images/s ({remote_text(body.get('images'))} images in "
        f"{body.get('wall_s', 0):.1f}s, routing {remote_text(body.get('policy'))}: "
        f"{remote_text(body.get('per_replica'))}); seconds per image p50 {_secs(latency.get('p50'))}, "
        f"p90 {_secs(latency.get('p90'))}, p99 {_secs(latency.get('p99'))}; T_max − T_min = "
        f"{body.get('t_max_minus_t_min_s', 0):.3f}s, imbalance {body.get('imbalance', 0):.3f}"
    )
    for event in body.get("lost", []):
        output.line(
            f"[bold yellow]replica {remote_text(event.get('replica'))} lost:[/bold yellow] "
            f"{remote_text(str(event.get('why')))}"
        )
    for name, ref in body.get("references", {}).items():
        where = f" on {remote_text(ref['node_ip'])}" if ref.get("node_ip") else ""
        output.line(
            f"÷ {remote_text(name.replace('_', ' '))}{where}: {_ratio(ref.get('ratio'))} "
            f"({ref.get('images_per_s', 0):.3f} images/s"
            + (f", imbalance {ref['imbalance']:.3f})" if ref.get("imbalance") is not None else ")")
        )
    check = body.get("output_check")
    if check:
        verdict = "identical" if check.get("identical") else "[red]DIFFERENT[/red]"
        output.line(
            f"first image vs diffusers' StableDiffusionPipeline: {verdict} "
            f"(max |difference| {check.get('max_abs_diff', 0):.2e}, tolerance {remote_text(check.get('tolerance'))})"
        )


def render_bench(output: Output, body: dict[str, Any]) -> None:
    """Per-node table with a bar of busy time T_i, then throughput, latency, balance and references."""
    if body.get("kind") == "image":
        render_images(output, body)
        return
    stages = body.get("stages", [])
    multi = len(body.get("replicas", [])) > 1
    _stage_table(output, stages, multi)
    bar_chart(
        output,
        "busy time T_i per node:",
        [(_stage_label(s, multi), s["busy_s"], f"{s['busy_s']:.3f}s") for s in stages],
    )
    _summary(output, body, stages)
    _latency(output, body.get("latency_s", {}))
    hop = body.get("hop_overhead")
    if hop:
        output.line(_hop_line(hop))
    _references(output, body)
    if multi:
        loads = ", ".join(
            f"#{r['index']} {r['requests']} req / {r['micro_batches']} mb" + (" (lost)" if r.get("lost") else "")
            for r in body.get("replicas", [])
        )
        output.line(f"replica load (power of two choices): {remote_text(loads)}")
    _faults(output, body)
    render_sweep(output, body.get("sweep"))
    for finding in body.get("network", []):
        colour = "yellow" if finding["status"] != "ok" else "dim"
        output.line(
            f"[{colour}]network {remote_text(finding['id'])} {remote_text(finding['host'])}: "
            f"{remote_text(finding['message'])}[/{colour}]"
        )
    _memory(output, body.get("memory"))
    check = body.get("output_check")
    if check and check.get("skipped"):
        output.line(f"[yellow]output check skipped: {remote_text(str(check['skipped']))}[/yellow]")
    elif check:
        output.line(
            f"sharded vs unsharded greedy output: {_verdict(check)} "
            f"({remote_text(check.get('compared_requests'))} requests)"
        )


def _verdict(check: dict[str, Any]) -> str:
    """identical; in reduced precision, within its tolerance (bench/outputcheck.py); else DIFFERENT."""
    tolerance = check.get("tolerance") or {}
    if check.get("identical"):
        return "identical"
    if tolerance.get("within"):
        return (
            f"[yellow]within {remote_text(tolerance['dtype'])} tolerance[/yellow]: every token among the reference's "
            f"top {remote_text(tolerance['top_k'])}, argmax agreed at {100 * (tolerance.get('argmax_agreed') or 0):.1f}"
            f" % of {remote_text(tolerance.get('positions'))} positions"
        )
    return "[red]DIFFERENT[/red]"


def _memory(output: Output, memory: dict[str, Any] | None) -> None:
    """Each stage's node: the container's peak use and the stage's planned bytes against its capacity."""
    if not memory:
        return
    items = []
    for stage in memory.get("stages", []):
        used, limit = stage.get("working_set_bytes"), stage.get("limit_bytes")
        text = f"{remote_text(_host(stage))} planned {_gb(stage.get('planned_bytes'))} of {_gb(stage.get('capacity_bytes'))}"
        if used:
            text += f", used {_gb(used)}" + (f" of {_gb(limit)} limit" if limit else "")
        items.append(text)
    output.line(
        f"memory ({remote_text(memory.get('dtype'))}, model {_gb(memory.get('model_bytes'))}): " + "; ".join(items)
    )


def _gb(value: Any) -> str:
    return f"{value / 1e9:.2f} GB" if isinstance(value, int | float) else "?"


def _hop_line(hop: dict[str, Any]) -> str:
    """The per-hop cost of the way the run passed activations, next to the other way (same run)."""
    line = f"per-hop overhead (no-op stages): {1000 * hop['per_hop_s']:.2f} ms per stage per step"
    direct, driver = hop.get("per_hop_direct_s"), hop.get("per_hop_via_driver_s")
    if direct and driver:
        line += (
            f" (stage to stage {1000 * direct:.2f} ms, via the driver {1000 * driver:.2f} ms: {driver / direct:.2f}x)"
        )
    return line


def render_sweep(output: Output, sweep: dict[str, Any] | None) -> None:
    if not sweep:
        return
    points = sweep.get("points", [])
    if sweep.get("kind") == "batch":
        table = Table(title="sweep: micro-batch size", title_justify="left")
        for column in ("micro-batch", "tokens/s", "TTFT p50 (s)", "TPOT p50 (s)", "e2e p50 (s)"):
            table.add_column(column, justify="right")
        for p in points:
            lat = p.get("latency_s", {})
            table.add_row(
                remote_text(p["micro_batch"]),
                f"{p['tokens_per_s']:.1f}",
                *(_secs((lat.get(k) or {}).get("p50"), 4) for k in ("ttft", "tpot", "e2e")),
            )
        output.out.print(table)
        rows = [
            (f"micro-batch {p['micro_batch']}", p["tokens_per_s"], f"{p['tokens_per_s']:.1f} tok/s") for p in points
        ]
        bar_chart(output, "tokens/s vs micro-batch:", rows)
        output.line(f"best micro-batch: {remote_text(sweep.get('best_micro_batch'))}")
        return
    table = Table(title="sweep: nodes", title_justify="left")
    for column in ("nodes", "tokens/s", "efficiency vs linear", "imbalance"):
        table.add_column(column, justify="right")
    for p in points:
        table.add_row(
            remote_text(p["nodes"]), f"{p['tokens_per_s']:.1f}", f"{p['efficiency']:.2f}", f"{p['imbalance']:.3f}"
        )
    output.out.print(table)
    base = points[0]["tokens_per_s"] if points else 0.0
    rows = []
    for p in points:
        rows.append((f"{p['nodes']} node(s)", p["tokens_per_s"], f"{p['tokens_per_s']:.1f} tok/s"))
        rows.append((f"{p['nodes']} linear", base * p["nodes"], f"{base * p['nodes']:.1f} tok/s (linear)"))
    bar_chart(output, "tokens/s vs nodes, against linear scaling:", rows)


def save_svg(body: dict[str, Any], path: Path, title: str = "raycluster bench") -> None:
    """The same rendering (tables, the T_i chart, sweep curves) as an SVG file a browser opens."""
    console = Console(record=True, file=io.StringIO(), width=140, highlight=False, force_terminal=True)
    recorder = Output(False, stdout=io.StringIO(), stderr=io.StringIO())
    recorder.out = console
    render_bench(recorder, body)
    console.save_svg(str(path), title=title)
