"""`bench --serve` end to end against a real local service: Ray Serve with the tiny chat Llama over two stages,
benchmarked by the library (verbs/serve_bench.py) and by the CLI in a subprocess (`--url`, `--json`, Ctrl-C)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("transformers")

from raycluster_cli.errors import OperationError  # noqa: E402
from raycluster_cli.render.serve_bench import SVG_NS, save_serve_svg  # noqa: E402
from raycluster_cli.serve.app import build_app  # noqa: E402
from raycluster_cli.serve.scheduler import Limits  # noqa: E402
from raycluster_cli.serve.settings import ServeSettings  # noqa: E402
from raycluster_cli.verbs.serve_bench import (  # noqa: E402
    LoadPlan,
    ServeBenchReport,
    ServiceClient,
    ServiceTarget,
    run_blocking,
)
from raycluster_cli.verbs.serve_load import stage_times  # noqa: E402

from ..local_ray import local_serve, write_keys  # noqa: E402
from ..serve_checkpoint import write_chat_llama  # noqa: E402
from .test_serve_openai import TOKEN, _wait_ready  # noqa: E402

MODEL = "tiny-chat-llama"
RATES = (2.0, 6.0)
REQUESTS = 8


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceTarget]:
    path = write_chat_llama(tmp_path_factory.mktemp("serve") / MODEL)
    settings = ServeSettings(
        model_path=str(path),
        keys_file=write_keys(tmp_path_factory.mktemp("keys") / "keys.json", {"default": TOKEN}),
        stages=2,
        split=(2, 1),
        num_threads=1,
        limits=Limits(slots=8, step_tokens=64, prefill_chunk=16, max_seq=128, max_waiting=64),
    )
    # address="local": a new instance, never one another test started on this machine
    with local_serve(build_app(settings, health_check_period_s=2), address="local") as root:
        _wait_ready(f"{root}/v1")
        yield ServiceTarget(f"{root}/v1", TOKEN)


def _status(target: ServiceTarget) -> dict[str, Any]:
    return asyncio.run(ServiceClient(target, 60).status())


def _status_since(target: ServiceTarget, since: float) -> dict[str, Any]:
    return asyncio.run(ServiceClient(target, 60).status(since=since))


def test_an_idle_service_shows_no_busy_time_and_counters_move_only_with_work(target: ServiceTarget) -> None:
    before = _status(target)
    assert before["limits"]["max_seq"] == 128 and before["model"] == MODEL
    stages = before["pipelines"][0]["stages"]
    assert [s["blocks"] for s in stages] == [2, 1] and all(s["steps"] > 0 for s in stages)  # the readiness probe
    assert before["pipelines"][0]["slots"] == 16  # 8 sequences for each of its 2 steps in flight
    assert before["pipelines"][0]["links"] == "direct" and "links_note" not in before["pipelines"][0]
    # each stage's device and the form its products take per row count, as it measured them when it loaded
    assert [s["device"] for s in stages] == ["cpu", "cpu"] and all("packed_mb" in s["matmuls"] for s in stages)
    # the ingress froze its start-up heap and times its full collections; each stage counts its own seconds in them
    assert before["ingress_gc"]["frozen_objects"] > 10_000 and all(s["gc_s"] >= 0 for s in stages)
    # the front end's CPU: the ingress's own process, and Serve's proxy found beside it (another process)
    front = before["front_end"]
    assert front["ingress_cpu_s"] > 0 and front["proxy_cpu_s"] > 0 and front["proxy_pid"] != front["ingress_pid"]
    idle = stage_times(before, _status(target), wall_s=1.0)
    assert [(s["busy_s"], s["steps"]) for s in idle["stages"]] == [(0.0, 0), (0.0, 0)]
    # the anatomy from the service's own clock on: no step since, none to show; a since that is no number: 400
    assert _status_since(target, before["now"] + 3600)["pipelines"][0]["anatomy"] is None
    with pytest.raises(OperationError, match="since must be a number"):
        _status_since(target, "soon")  # type: ignore[arg-type]


def test_the_benchmark_measures_every_request_and_each_stages_time(target: ServiceTarget, tmp_path: Path) -> None:
    plan = LoadPlan(RATES, REQUESTS, True, 0, (4, 40), (6, 20), seed=5, request_timeout_s=120)
    report = run_blocking(target, plan, ServeBenchReport(), timeout_s=600)
    body = report.to_dict()
    assert body["model"] == MODEL and body["max_seq"] == 128 and not body["interrupted"]
    assert body["workload"]["tokens_per_word"] == pytest.approx(1.0, abs=0.1)  # word-level tokenizer (+ BOS)
    assert [(r["kind"], r.get("rate")) for r in body["runs"]] == [
        ("poisson", 2.0),
        ("poisson", 6.0),
        ("saturation", None),
    ]
    for run in body["runs"]:
        assert (run["requests"], run["completed"], run["failed"]) == (REQUESTS, REQUESTS, 0), run["errors"]
        for request in run["per_request"]:
            assert 0 < request["ttft_s"] <= request["e2e_s"]
            assert request["output_tokens"] == request["max_tokens"]  # ignore_eos: the asked length, always
            assert 4 <= request["prompt_tokens"] <= 41  # the service's own count (+ BOS)
        assert run["output_tokens"] == sum(r["max_tokens"] for r in run["per_request"])
        assert run["output_tokens_per_s"] == pytest.approx(run["output_tokens"] / run["wall_s"])
        lat = run["latency_s"]
        assert lat["ttft"]["p50"] <= lat["ttft"]["p99"] <= lat["e2e"]["p99"]
        assert lat["tpot"]["p50"] > 0 and lat["itl"]["p50"] > 0
        # every step crosses both stages: equal steps, each stage busy, the balance figures from them
        steps = [s["steps"] for s in run["stages"]]
        assert len(steps) == 2 and steps[0] == steps[1] > 0
        assert all(0 < s["busy_s"] < run["wall_s"] for s in run["stages"])
        assert 0 < run["of_ceiling"] <= 1 and run["imbalance"] >= 0
        # every streamed token went through the ingress and the proxy: both spent CPU on the run's tokens
        front = run["front_end"]
        assert front["ingress_cpu_s"] > 0 and front["proxy_cpu_s"] > 0
        assert front["ingress_ms_per_token"] == pytest.approx(front["ingress_cpu_s"] / run["output_tokens"] * 1e3, 0.01)
    saturation = body["runs"][-1]
    assert saturation["concurrency"] == REQUESTS
    # all at once keeps more sequences in each step than arrivals spread at 2/s: fewer steps per token
    per_token = [r["stages"][0]["steps"] / r["output_tokens"] for r in body["runs"]]
    assert per_token[2] < per_token[0]
    # where a step's time went: the real stages' and engine's timelines, matched step by step
    anatomy = saturation["anatomy"]["0"]
    # over this run's steps only (`?since=` the status before it), not the Poisson runs' before it
    assert min(saturation["stages"][0]["steps"], 100) <= anatomy["steps"] <= saturation["stages"][0]["steps"]
    compute = [s["compute_ms"] for s in anatomy["stages"]]
    assert len(compute) == 2 and all(c > 0 for c in compute)
    assert anatomy["round_trip_ms"] > max(compute) and 0 < anatomy["in_flight"] <= 2.05
    assert all(s["link_ms"] >= 0 and 0 <= s["idle_share"] < 1 for s in anatomy["stages"])

    svg = tmp_path / "latency.svg"
    save_serve_svg(body, svg)
    root = ET.parse(svg).getroot()
    ns = f"{{{SVG_NS}}}"
    circles = root.iter(f"{ns}circle")
    by_series: dict[str, list[str]] = {}
    for point in circles:
        by_series.setdefault(point.get("data-series", ""), []).append(point.get("data-rate", ""))
    assert by_series == {s: ["2", "6"] for s in ("ttft-p50", "ttft-p99", "tpot-p50", "tpot-p99")}
    squares = [r for r in root.iter(f"{ns}rect") if r.get("data-rate") == "saturation"]
    assert len(squares) == 4


def test_sampled_runs_send_temperature_and_top_p_to_the_service(target: ServiceTarget) -> None:
    plan = LoadPlan((), 4, True, 0, (8, 8), (6, 6), seed=2, request_timeout_s=120, temperature=0.8, top_p=0.95)
    body = run_blocking(target, plan, ServeBenchReport(), timeout_s=300).to_dict()
    assert body["workload"]["sampling"] == {"temperature": 0.8, "top_p": 0.95}
    assert body["workload"]["stage_counters"] is True  # raycluster's own service: its status page answered
    (run,) = body["runs"]
    assert (run["completed"], run["failed"], run["output_tokens"]) == (4, 0, 24), run["errors"]
    # the fields reach the service: a temperature it refuses fails every request with its 400 naming the field
    refused = LoadPlan((), 2, True, 0, (8, 8), (6, 6), request_timeout_s=60, temperature=3.0)
    (run,) = run_blocking(target, refused, ServeBenchReport(), timeout_s=120).to_dict()["runs"]
    assert run["failed"] == 2 and all("HTTP 400" in e and "temperature" in e for e in run["errors"]), run["errors"]


def _cli(inventory: Path, state: Path, *args: str) -> subprocess.Popen[str]:
    env = os.environ | {"RAYCLUSTER_STATE_DIR": str(state), "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.Popen(
        [sys.executable, "-m", "raycluster_cli", "bench", "--serve", "-i", str(inventory), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _inventory(tmp_path: Path) -> tuple[Path, Path]:
    """An inventory naming cluster `t` (no host is contacted with --url) and the service's key where `serve` keeps
    it (the cluster's token beside it is not what the service takes)."""
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("cluster: t\nimage: raycluster/node:0.1.0\nhosts:\n  - {address: 127.0.0.1, role: head}\n")
    (tmp_path / "state" / "t" / "service-keys").mkdir(parents=True)
    (tmp_path / "state" / "t" / "auth-token").write_text("0123456789abcdef" * 4 + "\n")
    (tmp_path / "state" / "t" / "service-keys" / "default").write_text(TOKEN + "\n")
    return inventory, tmp_path / "state"


def test_the_cli_gives_one_document_and_ctrl_c_keeps_what_was_measured(target: ServiceTarget, tmp_path: Path) -> None:
    inventory, state = _inventory(tmp_path)
    saved = tmp_path / "result.json"
    args = [f"--url={target.url}", "--rates=4", "--requests=4", "--output-tokens=4:8", f"--save-result={saved}"]
    done = _cli(inventory, state, *args, "--json")
    out, err = done.communicate(timeout=300)
    assert done.returncode == 0, err[-2000:]
    doc = json.loads(out)
    assert doc["ok"] is True and [r["kind"] for r in doc["runs"]] == ["poisson", "saturation"]
    assert json.loads(saved.read_text())["runs"] == doc["runs"]
    assert TOKEN not in out + err  # the key is never printed
    (state / "t" / "service-keys" / "default").unlink()  # another key file, named on the command line
    key_file = tmp_path / "my-key"
    key_file.write_text(TOKEN + "\n")
    human = _cli(inventory, state, *args, "--seed=3", f"--api-key-file={key_file}")
    out, err = human.communicate(timeout=300)
    assert human.returncode == 0, err[-2000:]
    assert "Poisson 4/s" in out and "4 at once" in out and "busy time T_i per node" in out
    assert "imbalance" in out and TOKEN not in out + err

    # a long saturation run interrupted once its first requests are back: exit 130, the finished ones kept
    slow = _cli(
        inventory,
        state,
        f"--url={target.url}",
        f"--api-key-file={key_file}",
        "--rates=",
        "--requests=200",
        "--output-tokens=60",
        "--concurrency=2",
        "--json",
    )
    time.sleep(0.5)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "saturation run" not in (
        line := slow.stderr.readline() if slow.stderr else ""
    ):
        assert line or slow.poll() is None, "the benchmark ended before its saturation run"
    time.sleep(6.0)  # a few requests of 60 tokens finish
    slow.send_signal(signal.SIGINT)
    out, err = slow.communicate(timeout=60)
    assert slow.returncode == 130, err[-2000:]
    doc = json.loads(out)
    assert doc["ok"] is False and doc["interrupted"] is True
    (run,) = doc["runs"]
    assert run["interrupted"] is True and run["kind"] == "saturation"
    assert 0 < run["completed"] < 200 and all(r["output_tokens"] == 60 for r in run["per_request"])
