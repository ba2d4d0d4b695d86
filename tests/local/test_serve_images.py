"""The image service on a real two-node Ray (``ray.cluster_utils.Cluster`` on loopback) under real Ray Serve, called
by the real ``openai`` client, checked against diffusers' own StableDiffusionPipeline.

Both raylets hold the whole tiny pipeline, so the ingress places a replica on each, times each on a real image and
routes by those times.  Every PNG that comes back must decode (PIL) and equal diffusers' pipeline output for the
same prompt, seed (image i of n: seed + i) and steps, converted to 8 bits as diffusers' ``output_type="pil"`` does,
within ±1 per channel: both are float32 on CPU, the same code order, so the floats agree to ~1e-6 and only a value
sitting on a rounding edge can move one level.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
pytest.importorskip("diffusers")
openai = pytest.importorskip("openai")
np = pytest.importorskip("numpy")
Image = pytest.importorskip("PIL.Image")
psutil = pytest.importorskip("psutil")
import ray._private.services as services  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from raycluster_cli.serve.image_app import ImageSettings, build_image_app  # noqa: E402

from ..diffusion_checkpoint import diffusers_image, write_tiny_sd  # noqa: E402
from ..local_ray import write_keys  # noqa: E402

TOKEN = "test-cluster-token"
MODEL = "tiny-sd"
STEPS = 3
EXPENSIVE = 600  # steps: 200× the calibration image's work
MIB = 1024 * 1024


@dataclass
class Service:
    base_url: str
    path: Path

    def client(self, key: str = TOKEN) -> Any:
        return openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=180)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _raw(url: str, body: bytes | None = None, token: str | None = TOKEN) -> tuple[int, dict[str, Any], Any]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    request = urllib.request.Request(url, data=body, headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    path = write_tiny_sd(tmp_path_factory.mktemp("serve-images") / MODEL)
    keys = write_keys(tmp_path_factory.mktemp("keys") / "keys.json", {"default": TOKEN})
    # the deadline's floor low, so an image of many steps would outrun one learned from a 3-step image
    settings = ImageSettings(
        model_path=str(path), keys_file=keys, steps=STEPS, num_threads=1, max_waiting=6, max_steps=EXPENSIVE,
        deadline_floor_s=1.0,
    )  # fmt: skip
    port = _free_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        mp.setattr(services, "get_node_ip_address", lambda *args, **kwargs: "127.0.0.1")  # see test_bench_images_local
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 2,
                "memory": 2048 * MIB,
                "include_dashboard": False,
                "node_ip_address": "127.0.0.1",
            },
        )
        cluster.add_node(num_cpus=1, memory=2048 * MIB, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        try:
            serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
            # serve.run returns once the ingress is built: placed, and a real image timed on every replica
            serve.run(build_image_app(settings, health_check_period_s=2), name="raycluster", route_prefix="/")
            yield Service(f"http://127.0.0.1:{port}/v1", path)
        finally:
            serve.shutdown()
            ray.shutdown()
            cluster.shutdown()


def _decoded(b64: str) -> Any:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG" and image.mode == "RGB"
    return np.asarray(image).astype(np.int16)


def _reference(path: Path, prompt: str, seed: int, size: int = 16) -> Any:
    floats = diffusers_image(path, prompt, seed, STEPS, size)[0]
    return (floats * 255).round().astype(np.int16)  # diffusers' numpy_to_pil


def test_generate_returns_pngs_equal_to_diffusers_for_each_seed(service: Service) -> None:
    answer = service.client().images.generate(
        model=MODEL, prompt="a blue cat on the hill", n=3, size="16x16", response_format="b64_json",
        extra_body={"seed": 11},
    )  # fmt: skip
    assert len(answer.data) == 3
    for i, item in enumerate(answer.data):
        got = _decoded(item.b64_json)
        want = _reference(service.path, "a blue cat on the hill", 11 + i)
        assert got.shape == want.shape == (16, 16, 3)
        assert int(np.abs(got - want).max()) <= 1, f"image {i} (seed {11 + i}) differs from diffusers"
    assert not np.array_equal(_decoded(answer.data[0].b64_json), _decoded(answer.data[1].b64_json))
    # another size than the checkpoint's own, and the same seed again gives the same image
    again = service.client().images.generate(
        model=MODEL, prompt="a blue cat on the hill", size="24x24", extra_body={"seed": 11}
    )
    got = _decoded(again.data[0].b64_json)
    assert int(np.abs(got - _reference(service.path, "a blue cat on the hill", 11, 24)).max()) <= 1


def test_both_replicas_made_images_and_status_shows_the_placement(service: Service) -> None:
    client = service.client()
    client.images.generate(model=MODEL, prompt="a red tree", n=6, extra_body={"seed": 1})
    status, body, _ = _raw(f"{service.base_url.removesuffix('/v1')}/raycluster/status")
    assert status == 200 and body["kind"] == "image"
    assert "a replica on each" in body["why"] and body["replicas"] == 2
    rows = body["pipelines"]
    assert [r["stages"][0]["parts"] for r in rows] == [["text", "unet", "vae"]] * 2
    assert all(r["s_per_image"] > 0 and r["served"] >= 1 for r in rows), rows
    assert len({r["stages"][0]["node_id"] for r in rows}) == 2
    assert sum(n["calls"] for n in body["nodes"]) >= 6 + 2  # the calibration images too
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert _raw(f"{service.base_url.removesuffix('/v1')}/health", token=None)[:2] == (
        200,
        {"status": "ok", "replicas": 2},
    )


def test_errors_have_the_openai_shape(service: Service) -> None:
    with pytest.raises(openai.AuthenticationError):
        service.client(key="wrong").images.generate(model=MODEL, prompt="a cat")
    status, bare, _ = _raw(f"{service.base_url}/images/generations", json.dumps({"prompt": "a cat"}).encode(), None)
    assert status == 401 and set(bare["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as url:
        service.client().images.generate(model=MODEL, prompt="a cat", response_format="url")
    assert url.value.body["param"] == "response_format" and "b64_json" in url.value.body["message"]
    with pytest.raises(openai.BadRequestError) as size:
        service.client().images.generate(model=MODEL, prompt="a cat", size="20x16")  # type: ignore[arg-type]
    assert size.value.body["param"] == "size" and "multiples of 8" in size.value.body["message"]
    with pytest.raises(openai.NotFoundError) as missing:
        service.client().images.generate(model="dall-e-3", prompt="a cat")
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        service.client().images.generate(model=MODEL, prompt="a cat", n=11)


def test_bench_serve_measures_images_per_second_and_each_nodes_busy_time(service: Service, tmp_path: Path) -> None:
    """`bench --serve`'s runs (verbs/serve_bench.py, its own HTTP client) against the image service."""
    from xml.etree import ElementTree

    from raycluster_cli.render.base import Output
    from raycluster_cli.render.serve_bench import render_serve_bench, save_serve_svg
    from raycluster_cli.verbs import serve_bench

    target = serve_bench.ServiceTarget(service.base_url, TOKEN)
    plan = serve_bench.LoadPlan(rates=(2.0,), requests=8, saturation=True, concurrency=4, seed=3, request_timeout_s=120)
    body = serve_bench.run_blocking(target, plan, serve_bench.ServeBenchReport(), timeout_s=600).to_dict()
    assert body["workload"]["kind"] == "image" and body["workload"]["size"] == 16 and body["model"] == MODEL
    assert [r["kind"] for r in body["runs"]] == ["poisson", "saturation"]
    for run in body["runs"]:
        assert run["completed"] == 8 and run["failed"] == 0, run["errors"]
        assert run["images_per_s"] == pytest.approx(8 / run["wall_s"])
        q = run["latency_s"]["e2e"]
        assert 0 < q["p50"] <= q["p90"] <= q["p99"] <= run["wall_s"]
        assert sum(r["images"] for r in run["replicas"]) == 8  # the service's own count of what each made
        assert sum(s["calls"] for s in run["stages"]) == 8 and all(s["busy_s"] >= 0 for s in run["stages"])
        assert all(r["png_bytes"] > 0 for r in run["per_request"])
    saturated = body["runs"][-1]
    busy = [s["busy_s"] for s in saturated["stages"]]
    assert saturated["imbalance"] == pytest.approx((max(busy) - min(busy)) / (sum(busy) / len(busy)), rel=1e-6)
    buffer = io.StringIO()
    render_serve_bench(Output(False, stdout=buffer, stderr=io.StringIO()), body)
    assert "seconds per image: p50 / p90 / p99" in buffer.getvalue() and "T_i per node" in buffer.getvalue()
    save_serve_svg(body, tmp_path / "images.svg")
    points = ElementTree.parse(tmp_path / "images.svg").getroot().iter("{http://www.w3.org/2000/svg}circle")
    assert {p.get("data-series") for p in points} == {"e2e-p50", "e2e-p99"}


def _status(service: Service) -> dict[str, Any]:
    status, body, _ = _raw(f"{service.base_url.removesuffix('/v1')}/raycluster/status")
    assert status == 200, body
    return body


def _settled(service: Service, replicas: int, timeout_s: float = 240.0) -> dict[str, Any]:
    """The status once no replica is being re-grown and ``replicas`` serve."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = _status(service)
        if body["regrowing"] == 0 and body["replicas"] == replicas:
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.5)


def test_an_expensive_request_within_the_bounds_does_not_kill_a_replica(service: Service) -> None:
    """200× the calibration image's work (600 steps) runs far past the deadline a 3-step image taught (20× its
    seconds, at least 1 s here): its deadline scales with its work, and a replica past it answers a ping, so
    nothing is lost and both replicas serve afterwards.  One step more than the bound is a 400 naming the field."""
    before = _status(service)
    assert before["replicas"] == 2
    learned = max(max(1.0, 20 * r["s_per_image"]) for r in before["pipelines"])
    began = time.monotonic()
    answer = service.client().images.generate(
        model=MODEL, prompt="a red house", size="16x16", extra_body={"seed": 2, "num_inference_steps": EXPENSIVE}
    )
    took = time.monotonic() - began
    assert len(answer.data) == 1 and _decoded(answer.data[0].b64_json).shape == (16, 16, 3)
    assert took > learned, f"{took:.1f} s: the test needs an image past the unscaled deadline {learned:.1f} s"
    after = _status(service)
    assert after["replicas"] == 2 and not [e for e in after["events"] if e["event"] == "lost"], after["events"]
    served = [r["served"] for r in after["pipelines"]]
    service.client().images.generate(model=MODEL, prompt="a red tree", n=4, extra_body={"seed": 3})
    again = _status(service)
    assert all(r["served"] > s for r, s in zip(again["pipelines"], served, strict=True)), again["pipelines"]
    with pytest.raises(openai.BadRequestError) as refused:
        service.client().images.generate(model=MODEL, prompt="a cat", extra_body={"num_inference_steps": EXPENSIVE + 1})
    assert refused.value.body["param"] == "num_inference_steps"
    with pytest.raises(openai.BadRequestError) as big:
        service.client().images.generate(model=MODEL, prompt="a cat", size="4096x4096")  # type: ignore[arg-type]
    assert big.value.body["param"] == "size"


def test_a_replica_killed_with_ray_kill_is_regrown(service: Service) -> None:
    """One replica's actor killed for real (``ray.kill``, the faster one, so an image goes there): its image
    moves to the other, and a new replica is
    placed and timed in the background, so two serve again, each making images equal to diffusers'."""
    rows = _status(service)["pipelines"]
    live = [r for r in rows if r["state"] == "live"]
    assert len(live) == 2 and all(r["stages"][0]["actor"] for r in live)
    fastest = min(live, key=lambda r: r["s_per_image"])  # the first image goes there
    ray.kill(ray.get_actor(fastest["stages"][0]["actor"], namespace="raycluster-images"))
    answer = service.client().images.generate(model=MODEL, prompt="a small green tree", n=2, extra_body={"seed": 5})
    for i, item in enumerate(answer.data):
        assert int(np.abs(_decoded(item.b64_json) - _reference(service.path, "a small green tree", 5 + i)).max()) <= 1
    body = _settled(service, 2)
    events = [e["event"] for e in body["events"]]
    assert events.count("lost") == 1 and events[-1] == "re-grown", body["events"]
    new = body["pipelines"][-1]
    assert new["state"] == "live" and new["index"] == len(rows) and new["calibrated_s_per_image"] > 0
    answer = service.client().images.generate(model=MODEL, prompt="a blue cat", n=4, extra_body={"seed": 9})
    for i, item in enumerate(answer.data):
        assert int(np.abs(_decoded(item.b64_json) - _reference(service.path, "a blue cat", 9 + i)).max()) <= 1
    assert _status(service)["pipelines"][-1]["served"] >= 1


def test_a_lost_replica_moves_its_images_and_none_left_answers_503(service: Service) -> None:
    """Runs last: kills the faster replica's process (its images go to the other, still equal to diffusers'), then every
    worker at once (503 with Retry-After while they are re-grown)."""
    body = _settled(service, 2)
    live = [r for r in body["pipelines"] if r["state"] == "live"]
    fastest = min(live, key=lambda r: r["s_per_image"])  # the first image goes there
    pid = ray.get(ray.get_actor(fastest["stages"][0]["actor"], namespace="raycluster-images").ping.remote(), timeout=30)
    lost_before = [r["state"] for r in body["pipelines"]].count("lost")
    os.kill(pid, signal.SIGKILL)
    answer = service.client().images.generate(model=MODEL, prompt="a small green tree", n=2, extra_body={"seed": 5})
    for i, item in enumerate(answer.data):
        assert int(np.abs(_decoded(item.b64_json) - _reference(service.path, "a small green tree", 5 + i)).max()) <= 1
    body = _status(service)
    assert [r["state"] for r in body["pipelines"]].count("lost") == lost_before + 1
    assert "lost" in [e["event"] for e in body["events"][-2:]]
    body = _settled(service, 2)
    for worker in psutil.process_iter(["cmdline", "status"]):
        if "ray::_DiffusionWorker" in " ".join(worker.info["cmdline"] or []):
            os.kill(worker.pid, signal.SIGKILL)
    status, refused, headers = _raw(
        f"{service.base_url}/images/generations", json.dumps({"prompt": "a cat", "seed": 1}).encode()
    )
    assert status == 503 and refused["error"]["type"] == "server_error" and headers["Retry-After"]
    health, down, headers = _raw(f"{service.base_url.removesuffix('/v1')}/health", token=None)
    assert health == 503 and down["error"]["type"] == "server_error" and headers["Retry-After"]
