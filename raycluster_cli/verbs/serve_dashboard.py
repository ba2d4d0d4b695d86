"""A Grafana dashboard of the service's own metrics (``serve.metrics``), written by `raycluster metrics` next to
the dashboards Ray generates: tokens and requests per second, time to first token, per output token and end to
end (p50 / p90 / p99 from the histograms), requests running and waiting and KV slots in use per pipeline, each
stage's busy share (an uneven split shows as stages apart), images per second and seconds per image request,
failovers and live replicas.  Pure data: no Grafana or
Prometheus is needed to make it, and every query names only metrics the service records."""

from __future__ import annotations

from typing import Any

from raycluster_cli.serve.metrics import COUNTER, HISTOGRAM, METRICS

FILE_NAME = "raycluster_serve_dashboard.json"
RATE = "[1m]"


def exported(name: str, part: str = "") -> str:
    """The name Prometheus sees: Ray's ``ray_`` prefix, ``_total`` on a counter, ``_bucket`` etc. on a histogram."""
    metric = METRICS[name]
    suffix = "_total" if metric.kind == COUNTER else (part if metric.kind == HISTOGRAM else "")
    return f"ray_{name}{suffix}"


def _quantiles(name: str) -> list[tuple[str, str]]:
    bucket = exported(name, "_bucket")
    return [
        (f'histogram_quantile({q}, sum by (le) (rate({bucket}{{model=~"$model"}}{RATE})))', f"p{round(q * 100)}")
        for q in (0.5, 0.9, 0.99)
    ]


def _panel(title: str, targets: list[tuple[str, str]], unit: str, index: int) -> dict[str, Any]:
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def panels() -> list[tuple[str, list[tuple[str, str]], str]]:
    """(title, [(PromQL, legend)], unit) of every panel, in order."""
    model = '{model=~"$model"}'
    return [
        (
            "Output tokens per second",
            [(f"sum(rate({exported('raycluster_serve_generation_tokens')}{model}{RATE}))", "generated")],
            "short",
        ),
        (
            "Requests ended per second, by why",
            [
                (
                    f"sum by (finish_reason) (rate({exported('raycluster_serve_requests')}{model}{RATE}))",
                    "{{finish_reason}}",
                )
            ],
            "reqps",
        ),
        ("Time to first token", _quantiles("raycluster_serve_time_to_first_token_seconds"), "s"),
        ("Time per output token", _quantiles("raycluster_serve_time_per_output_token_seconds"), "s"),
        ("End to end", _quantiles("raycluster_serve_e2e_request_latency_seconds"), "s"),
        (
            "Requests running and waiting, per pipeline",
            [
                (f"sum by (pipeline) ({exported('raycluster_serve_requests_running')}{model})", "running {{pipeline}}"),
                (f"sum by (pipeline) ({exported('raycluster_serve_requests_waiting')}{model})", "waiting {{pipeline}}"),
            ],
            "short",
        ),
        (
            "KV cache in use (rows, and the token budget), per pipeline",
            [
                (f"max by (pipeline) ({exported('raycluster_serve_kv_slots_used_ratio')}{model})", "rows {{pipeline}}"),
                (
                    f"max by (pipeline) ({exported('raycluster_serve_kv_tokens_used_ratio')}{model})",
                    "tokens {{pipeline}}",
                ),
            ],
            "percentunit",
        ),
        (
            "Stage busy share (even when the split is balanced)",
            [
                (
                    f"sum by (pipeline, stage, node_ip) (rate({exported('raycluster_serve_stage_busy_seconds')}"
                    f"{model}{RATE}))",
                    "pipeline {{pipeline}} stage {{stage}} on {{node_ip}}",
                )
            ],
            "percentunit",
        ),
        (
            "Images: per second, and seconds per request",
            [
                (f"sum(rate({exported('raycluster_serve_images')}{model}{RATE}))", "images/s"),
                (
                    f"sum by (outcome) (rate({exported('raycluster_serve_image_requests')}{model}{RATE}))",
                    "requests/s {{outcome}}",
                ),
                *_quantiles("raycluster_serve_image_request_seconds"),
            ],
            "short",
        ),
        (
            "Failovers and live replicas",
            [
                (f"sum(increase({exported('raycluster_serve_failovers')}{model}[5m]))", "failovers in 5 min"),
                (f"max({exported('raycluster_serve_replicas_live')}{model})", "live replicas"),
            ],
            "short",
        ),
    ]


def dashboard() -> dict[str, Any]:
    """The dashboard as Grafana imports it (a ``datasource`` and a ``model`` variable)."""
    return {
        "title": "raycluster serve",
        "uid": "raycluster-serve",
        "tags": ["raycluster", "ray"],
        "schemaVersion": 39,
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
                {
                    "name": "model",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": f"label_values({exported('raycluster_serve_replicas_live')}, model)",
                    "includeAll": True,
                    "allValue": ".*",
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                },
            ]
        },
        "panels": [_panel(title, targets, unit, i) for i, (title, targets, unit) in enumerate(panels())],
    }
