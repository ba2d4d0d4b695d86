"""`bench --serve`'s text report: errors, the T_i chart of the saturation run and its balance line, for a text
service (stages with blocks and steps, across pipelines) and an image service (replicas with parts and calls)."""

from __future__ import annotations

import io
from typing import Any

from raycluster_cli.render.base import Output
from raycluster_cli.render.serve_bench import render_serve_bench

BALANCE = {"wall_s": 2.0, "t_max_minus_t_min_s": 0.25, "imbalance": 0.125, "utilisation": 0.75}


def _text(body: dict[str, Any]) -> str:
    out = io.StringIO()
    render_serve_bench(Output(False, stdout=out, stderr=io.StringIO()), body)
    return out.getvalue()


def _run(kind: str, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "concurrency": 8, "rate": 2.0, "completed": 8, "failed": 0, "errors": [], **extra}


def test_text_service_shows_each_pipelines_stages_and_the_saturation_runs_balance() -> None:
    stages = [
        {"pipeline": 0, "node_ip": "10.0.0.1", "blocks": 5, "busy_s": 1.5, "steps": 40},
        {"pipeline": 1, "node_ip": "10.0.0.2", "blocks": 3, "busy_s": 1.25, "steps": 40},
    ]
    latency = {"ttft": {"p50": 0.1, "p99": 0.2}}
    poisson = _run("poisson", requests_per_s=1.0, output_tokens_per_s=10.0, latency_s=latency, errors=["timed out"])
    saturation = _run(
        "saturation", requests_per_s=2.0, output_tokens_per_s=20.0, latency_s=latency, stages=stages,
        of_ceiling=0.5, **BALANCE,
    )  # fmt: skip
    text = _text({"model": "m", "url": "u", "workload": {}, "runs": [poisson, saturation]})
    assert "Poisson 2/s: timed out" in text
    assert "busy time T_i per node (8 at once, wall 2.00s):" in text
    assert "#0 10.0.0.1 (5 blocks)" in text and "#1 10.0.0.2 (3 blocks)" in text and "1.250s, 40 steps" in text
    assert "imbalance 0.125, utilisation 0.75, the slowest stage busy 50% of the run" in text
    assert "garbage collections" not in text  # a service that does not count them says nothing of them
    paused = dict(saturation, ingress_gc={"full_collections": 3, "seconds": 0.045, "max_ms": 21.0})
    text = _text({"model": "m", "url": "u", "workload": {}, "runs": [paused]})
    assert "the ingress paused 3 time(s) for full garbage collections, 45 ms in all" in text and "21.0 ms" in text
    assert "front end" not in text  # a service that does not report it says nothing of it
    front = {"ingress_cpu_s": 3.0, "ingress_ms_per_token": 1.5, "proxy_cpu_s": 1.5, "proxy_ms_per_token": 0.75}
    text = _text({"model": "m", "url": "u", "workload": {}, "runs": [dict(saturation, front_end=front)]})
    assert "the front end's CPU per output token: the ingress 1.50 ms, Serve's proxy 0.75 ms" in text


def test_image_service_shows_each_replicas_parts_and_calls() -> None:
    stages = [{"node_ip": "10.0.0.3", "parts": ["unet", "vae"], "busy_s": 3.0, "calls": 12}]
    run = _run("saturation", images_per_s=1.5, latency_s={}, replicas=[{"images": 8}], stages=stages, **BALANCE)
    text = _text({"model": "sd", "url": "u", "workload": {"kind": "image"}, "runs": [run], "interrupted": True})
    assert "10.0.0.3 (unet+vae)" in text and "3.000s, 12 calls" in text
    assert "imbalance 0.125, utilisation 0.75\n" in text and "slowest stage" not in text
    assert "the images it finished" in text


def test_header_says_how_the_requests_sampled() -> None:
    sampled = {"sampling": {"temperature": 0.8, "top_p": 0.95}}
    assert "seed 0, temperature 0.8, top_p 0.95" in _text({"workload": {"seed": 0} | sampled, "runs": []})
    assert "seed 0, greedy" in _text({"workload": {"seed": 0, "sampling": {"temperature": 0.0}}, "runs": []})
    assert "seed 0, greedy" in _text({"workload": {"seed": 0}, "runs": []})  # a document from before the field
