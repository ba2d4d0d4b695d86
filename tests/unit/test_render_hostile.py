"""Every renderer, fed a document whose every string came from a hostile host or service: nothing it prints
drives the terminal (no escape sequence, no OSC 52 clipboard write, no bell, no carriage return), and rich markup
in the text is shown as text (a container state `[/x]` used to crash `status`)."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
from rich.console import Console

from raycluster_cli.checks.base import CheckResult, Status
from raycluster_cli.progress import HostPhase
from raycluster_cli.render import base, bench, checks, lifecycle, operate, serve_bench, up
from raycluster_cli.verbs.bench import BenchEvent

# A screen clear, an OSC 52 clipboard write (its payload must go too), a title, a bell, a carriage return, the
# 8-bit CSI, a closing tag with nothing open, a style, and a trailing backslash that would escape the next tag.
HOSTILE = "ok\x1b[2J\x1b]52;c;ZXZpbA==\x07\x1b]0;title\x07\r\x9b1m[/x][bold]z\\"
SHOWN = "ok[/x][bold]z"  # (rich doubles a trailing backslash escaped at the end of a markup text)
STRUCTURE = {"kind", "mode", "action", "status"}  # values that choose a shape, kept so every shape is drawn

# fmt: off
LAT = {"p50": 0.1, "p90": 0.2, "p99": 0.3}
STAGE = {"replica": 0, "index": 0, "host": "h", "node_ip": "n", "layers": 4, "busy_s": 1.0, "blocks": 2,
         "idle_fill_s": 0.1, "idle_between_s": 0.1, "idle_drain_s": 0.1, "quota_used": 0.5, "pipeline": 0,
         "steps": 3, "parts": ["unet"], "calls": 2, "planned_bytes": 1, "capacity_bytes": 2, "working_set_bytes": 1,
         "limit_bytes": 2}
RUN = {"kind": "saturation", "rate": 1.0, "concurrency": 2, "completed": 1, "failed": 1, "errors": ["e"],
       "requests_per_s": 1.0, "output_tokens_per_s": 1.0, "images_per_s": 1.0, "imbalance": 0.1, "wall_s": 1.0,
       "latency_s": {"ttft": LAT, "tpot": LAT, "itl": LAT, "e2e": LAT}, "stages": [STAGE], "replicas": [{"images": 1}],
       "t_max_minus_t_min_s": 0.1, "utilisation": 0.5, "of_ceiling": 0.5, "interrupted": True,
       "pipelines_changed": {"retired": 1, "new": 1}, "ingress_gc": {"full_collections": 1, "seconds": 0.1,
       "max_ms": 1.0}, "front_end": {"ingress_ms_per_token": 1.0, "proxy_ms_per_token": 1.0},
       "anatomy": {"0": {"steps": "s", "in_flight": "f", "stages": [{"compute_ms": 1.0, "idle_share": 0.5}]}}}
LIVE = {"pipelines": [{"index": 0, "state": "live", "served": 1, "links": "ray", "links_note": "note",
                       "stages": [{"node_ip": "n", "blocks": 2, "device": "cpu"}, {"parts": ["vae"]}]}],
        "events": [{"event": "rebalanced", "detail": "d"}]}
HOST = {"host": "h", "role": "head", "container": "running", "ray_node": "alive", "image_id": "sha256:0123456789abcdef",
        "ray_version": "2.0", "resources": {"CPU": 2, "GPU": 0, "accel": 1}, "error": "boom",
        "models": [{"digest": "d" * 64, "name": "m", "size": 10}]}
STATUS = {"cluster": "c", "state": "up", "hosts": [HOST], "totals": {"alive_nodes": 1, "hosts": 1,
          "resources": {"CPU": 2}},
          "service": {"record": {"model": "m", "url": "u", "kind": "text"}, "live": LIVE,
                      "serve": {"status": "RUNNING", "deployments": {"d": {"replicas": {"RUNNING": 1}}}}}}
BENCH = {"stages": [STAGE], "replicas": [{"index": 0, "requests": 1, "micro_batches": 1, "lost": True}] * 2,
         "tokens_per_s": 1.0, "imbalance": 0.1, "imbalance_capacity": 0.2, "latency_s": {"ttft": LAT},
         "hop_overhead": {"per_hop_s": 0.001}, "config": {"mode": "poisson", "rate": 1, "partition": "balanced"},
         "references": {"even": {"tokens_per_s": 1.0, "ratio": 1.0}, "unsharded": {"tokens_per_s": 1.0, "host": "h"},
                        "balanced": {"skipped": "why"},
                        "ceiling": {"ratio": 1.0, "gap": {"stage": "s", "idle_fill_s": 0.1, "idle_between_s": 0.1,
                                                          "idle_drain_s": 0.1}}},
         "split_choice": {"used": "even", "reason": "r"},
         "lost_nodes": [{"host": "h", "stage": 1, "replica": 0, "phase": "p", "requests_retried": 1, "error": "e"}],
         "network": [{"status": "warn", "id": "mtu", "host": "h", "message": "m"}],
         "memory": {"dtype": "fp32", "model_bytes": 1, "stages": [STAGE]},
         "output_check": {"skipped": "why"}, "retried_requests": 1,
         "sweep": {"kind": "batch", "points": [{"micro_batch": "m", "tokens_per_s": 1.0}], "best_micro_batch": "b"}}
IMAGES = {"kind": "image", "placement": {"why": "w", "replicas": [{"holders": [{"host": "h", "parts": ["unet"]}],
                                                                  "s_per_image": 1.0}]},
          "nodes": [{"host": "h", "parts": ["vae"], "busy_s": 1.0, "calls": 1}], "lost": [{"replica": 0, "why": "w"}],
          "references": {"one_node": {"node_ip": "n", "ratio": 1.0}}, "output_check": {"identical": False}}
SERVE = {"copies": [{"action": "sent", "source": "operator", "files_reused": 1}], "model_digest": "d" * 64,
         "model": "m", "url": "http://u/v1", "replicas": 1, "seconds": 1.0, "split": "s", "auth_token_file": "/t",
         "pipelines": [{"stages": [STAGE, {"node_ip": "n", "blocks": 1}], "why": "w", "s_per_image": 1.0}]}

Render = Callable[[base.Output, Any], object]


def _status_watch(output: base.Output, body: dict[str, Any]) -> None:
    with operate.live_status(output) as show:
        show(body)


def _exec_lines(output: base.Output, body: dict[str, Any]) -> None:
    operate.ExecPrinter(output, prefixed=True)(body["host"], "stdout", body["line"])
    operate.ExecPrinter(output, prefixed=False)(body["host"], "stderr", body["line"])
    operate.JobLogPrinter(output)(body["line"])


def _checks(output: base.Output, body: dict[str, Any]) -> None:
    data = {"to_head_bps": 1e9, "from_head_bps": 1e6, "rtt_ms": 0.1, "tool": body["tool"]}
    results = [CheckResult("network", body["host"], Status.OK, body["m"], body["m"], data),
               CheckResult("mtu", body["host"], Status.FAIL, body["m"], body["m"], {"mtu": body["m"]})]
    checks.render_checks(output, results)


def _up_board(output: base.Output, body: dict[str, Any]) -> None:
    board = up.UpBoard()
    board.take(HostPhase(body["host"], body["role"], "failed", body["detail"]))
    output.out.print(board.render())


def _bench_events(output: base.Output, body: dict[str, Any]) -> None:
    with bench.bench_progress(output) as sink:
        sink(BenchEvent(body["phase"], 1, 2, body["step"]))
        sink(BenchEvent(body["phase"], step="node lost", extra=body))
    output.progress()(body["phase"])
    with output.live_progress() as live:
        live(body["phase"])


RENDERERS: dict[str, tuple[Render, dict[str, Any]]] = {
    "status": (lifecycle.render_status, STATUS),
    "status --watch": (_status_watch, STATUS),
    "up": (lifecycle.render_up, {"nodes": [{"host": "h", "role": "head", "node_ip": "n", "alive": True, "action": "a",
                                       "reason": "r", "resources": {"CPU": 1}}],
                            "images": [{"method": "stream", "host": "h", "reason": "r", "bytes_sent": 1, "codec": "c",
                                        "seconds": 1.0, "source": "s"}], "warnings": ["w"], "seconds": 1.0,
                            "next": {"ray_address": "a", "dashboard_url": "d", "submit_job": "s", "status": "s",
                                     "logs": "l"}}),
    "up board": (_up_board, {"host": "h", "role": "worker", "detail": "d"}),
    "down": (lifecycle.render_down, {"removed": [{"container": "c", "host": "h"}], "purged": [{"item": "i", "host": "h"}],
                                "errors": [{"host": "h", "error": "e"}]}),
    "logs": (base.render_logs, {"out": "o", "hosts": [{"host": "h", "files": 1, "bytes": 1, "error_lines": 1,
                                                       "error": "", "first_errors": ["e"], "truncated": ["t"]}]}),
    "lab": (base.render_lab, {"hosts": [{"hostname": "h", "address": "a", "name": "n"}], "inventory": "i",
                              "removed": ["r"]}),
    "checks": (_checks, {"host": "h", "m": "m", "tool": "iperf3"}),
    "exec": (operate.render_exec, {"hosts": [{"host": "h", "error": "e", "rc": 1}, {"host": "g", "error": "", "rc": 2}]}),
    "exec lines": (_exec_lines, {"host": "h", "line": "l"}),
    "submit": (operate.render_submit, {"job": {"waited": True, "submission_id": "s", "status": "FAILED",
                                               "driver_exit_code": 1, "message": "m"}}),
    "dashboard": (operate.render_dashboard, {"cluster": "c", "url": "u", "head_dashboard": "h", "ray_version": "v",
                                             "auth_token_file": "t"}),
    "metrics": (operate.render_metrics, {"cluster": "c", "files": ["f"], "dashboards": ["d"], "dashboards_dir": "d",
                                         "warnings": ["w"], "targets": [
                                             {"target": "t", "host": "h", "role": "r", "in_ray_list": False,
                                              "up": False, "error": "e", "samples": 0}]}),
    "serve": (operate.render_serve, SERVE),
    "serve images": (operate.render_serve, {**SERVE, "kind": "image"}),
    "serve --stop": (operate.render_serve_stop, {"cluster": "c", "removed": True}),
    "bench": (bench.render_bench, BENCH),
    "bench images": (bench.render_bench, IMAGES),
    "bench events": (_bench_events, {"phase": "p", "step": "s", "host": "h", "stage": 1, "retried": 1, "error": "e"}),
    "bench --serve": (serve_bench.render_serve_bench, {"model": "m", "url": "u", "workload": {"seed": "s"},
                                                       "runs": [RUN, {**RUN, "kind": "poisson"}],
                                                       "interrupted": True}),
    "bench --serve images": (serve_bench.render_serve_bench, {"model": "m", "url": "u", "runs": [RUN],
                                                              "workload": {"kind": "image", "size": "s"}}),
}
# fmt: on


def _hostile(value: Any, key: str = "") -> Any:
    """`value` with every string in it (but those that choose its shape) replaced by HOSTILE."""
    if isinstance(value, dict):
        return {k: _hostile(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_hostile(v, key) for v in value]
    if isinstance(value, str) and key not in STRUCTURE:
        return HOSTILE
    return value


def _draw(render: Render, body: Any, terminal: bool) -> str:
    out, err = io.StringIO(), io.StringIO()
    output = base.Output(False, stdout=out, stderr=err)
    output.out = Console(file=out, width=400, highlight=False, soft_wrap=True)  # wide: no cell cut short
    if terminal:  # as on a terminal: rich's live views and styles drawn (the styles' own escapes then expected)
        output.out = Console(file=out, force_terminal=True, width=400, color_system=None)
        output.err = Console(file=err, force_terminal=True, width=400, color_system=None)
    render(output, body)
    return out.getvalue() + err.getvalue()


@pytest.mark.parametrize("name", RENDERERS)
def test_every_renderer_prints_hostile_strings_as_plain_text(name: str) -> None:
    render, body = RENDERERS[name]
    _draw(render, body, terminal=False)  # the sample itself draws
    text = _draw(render, _hostile(body), terminal=False)
    assert not set(text) & set("\x1b\x07\r\x9b\x00"), repr(text)
    assert "ZXZpbA" not in text and "title" not in text  # the OSC sequences went whole, their payloads with them
    assert SHOWN in text  # markup shown as written


@pytest.mark.parametrize("name", ["status", "status --watch", "up board", "bench events", "serve"])
def test_on_a_terminal_only_rich_writes_escapes(name: str) -> None:
    """On a terminal rich draws its own cursor moves; the hostile text adds no OSC, bell or carriage return."""
    render, body = RENDERERS[name]
    text = _draw(render, _hostile(body), terminal=True)
    assert "\x1b]" not in text and "\x07" not in text and "ZXZpbA" not in text and "\x9b" not in text
    assert "\x1b[2J" not in text
    assert "[/x][bold]z" in text


def test_a_resource_name_from_a_host_is_shown_as_text() -> None:
    body = _hostile(STATUS)
    body["hosts"][0]["resources"] = {"CPU": 1, HOSTILE: 2}
    text = _draw(lifecycle.render_status, body, terminal=False)
    assert SHOWN + "\\=2" in text and "\x1b" not in text
