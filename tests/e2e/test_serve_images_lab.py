"""`serve` of a diffusers checkpoint on the real 3-host lab: a tiny random Stable Diffusion written by the test on
this machine reaches every host, the head's container deploys the images API (the bench's replicas, one per node
that holds the pipeline, routed by measured speed), and the real `openai` client's ``images.generate`` returns PNGs
equal to diffusers' own StableDiffusionPipeline for the same prompt, seed (image i: seed + i) and steps, within one
8-bit level (float32 on CPU on both sides; a value on a rounding edge can move one level).
"""

from __future__ import annotations

import base64
import io
import json
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from ..diffusion_checkpoint import diffusers_image, write_tiny_sd
from .conftest import IP1, Lab
from .faults import wait_until

pytestmark = [pytest.mark.lab, pytest.mark.slow]

STEPS = 4


@dataclass
class Served:
    lab: Lab
    doc: dict[str, Any]
    path: Path
    token: str

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.doc["url"], api_key=key or self.token, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def served(lab_hosts: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    code, doc, err = lab_hosts.cli("up", timeout=1500)
    assert code == 0, err
    path = write_tiny_sd(tmp_path_factory.mktemp("serve-images") / "tiny-sd")
    (path / "NOTICE").write_text(f"raycluster image serve lab test {uuid.uuid4()}\n")  # a model no host holds yet
    code, doc, err = lab_hosts.cli("serve", f"--model-path={path}", "--image-max-steps=500", timeout=1200)
    assert code == 0, err[-4000:]
    token = Path(doc["api_key_file"]).read_text().strip()  # the service's own key (never the cluster's token)
    try:
        yield Served(lab_hosts, doc, path, token)
    finally:
        lab_hosts.cli("serve", "--stop", timeout=300)


def _pixels(b64: str) -> Any:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    assert image.format == "PNG"
    return np.asarray(image.convert("RGB")).astype(np.int16)


def test_every_host_gets_a_replica_and_the_images_equal_diffusers(served: Served) -> None:
    doc = served.doc
    assert doc["kind"] == "image" and doc["url"] == f"http://{IP1}:8000/v1" and doc["model"] == "tiny-sd"
    assert sorted(c["action"] for c in doc["copies"]) == ["sent"] * 3
    assert doc["replicas"] == 3 and "a replica on each" in doc["why"]
    assert sorted(p["stages"][0]["host"] for p in doc["pipelines"]) == sorted(c["host"] for c in doc["copies"])
    assert all(p["s_per_image"] > 0 for p in doc["pipelines"])
    answer = served.client().images.generate(
        model="tiny-sd", prompt="a red house on the hill", n=4, response_format="b64_json",
        extra_body={"seed": 21, "num_inference_steps": STEPS},
    )  # fmt: skip
    assert len(answer.data) == 4
    for i, item in enumerate(answer.data):
        want = (diffusers_image(served.path, "a red house on the hill", 21 + i, STEPS, 16)[0] * 255).round()
        assert int(np.abs(_pixels(str(item.b64_json)) - want.astype(np.int16)).max()) <= 1, f"image {i}"
    with pytest.raises(openai.AuthenticationError):
        served.client("not-the-token").images.generate(model="tiny-sd", prompt="a cat")
    with pytest.raises(openai.BadRequestError):
        served.client().images.generate(model="tiny-sd", prompt="a cat", response_format="url")


def test_an_image_of_many_steps_kills_no_replica(served: Served) -> None:
    """An image of 500 steps (the operator raised the bound from 150 with --image-max-steps; 125x the calibration's
    4) runs far past a deadline learned from the calibration's image: its replica answers the ping, so it is busy,
    not lost; every replica still serves after. One step more is a 400 naming the field, before any replica is
    asked."""
    answer = served.client().images.generate(
        model="tiny-sd", prompt="a long walk", n=1, response_format="b64_json",
        extra_body={"seed": 5, "num_inference_steps": 500},
    )  # fmt: skip
    assert len(answer.data) == 1
    with pytest.raises(openai.BadRequestError) as refused:
        served.client().images.generate(
            model="tiny-sd", prompt="a cat", response_format="b64_json", extra_body={"num_inference_steps": 501}
        )
    assert refused.value.body["param"] == "num_inference_steps"
    request = urllib.request.Request(
        served.doc["url"].removesuffix("/v1") + "/raycluster/status",
        headers={"Authorization": f"Bearer {served.token}"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        status = json.loads(reply.read())
    assert status["replicas"] == 3 and not [e for e in status["events"] if e.get("event") == "lost"], status["events"]


def test_bench_serve_measures_images_on_every_host(served: Served) -> None:
    code, doc, err = served.lab.cli("bench", "--serve", "--rates=2", "--requests=12", "--concurrency=6", timeout=900)
    assert code == 0, err[-3000:]
    assert doc["workload"]["kind"] == "image" and doc["workload"]["replicas"] == 3
    hosts = {p["stages"][0]["node_ip"] for p in served.doc["pipelines"]}
    for run in doc["runs"]:
        assert (run["completed"], run["failed"]) == (12, 0), run["errors"]
        assert {s["node_ip"] for s in run["stages"]} == hosts
        assert sum(r["images"] for r in run["replicas"]) == 12
        assert run["latency_s"]["e2e"]["p50"] <= run["latency_s"]["e2e"]["p99"]
    assert served.token not in str(doc) + err
    # the service's own metrics, through the head's Ray metrics agent (read by the Prometheus project's parser):
    # at least the 4 images of the test before and every image of these runs, on 3 live replicas
    made = 4 + 12 * len(doc["runs"])

    def metrics() -> dict[str, float]:
        with urllib.request.urlopen(f"http://{IP1}:8080/metrics", timeout=30) as response:
            text = response.read().decode()
        found: dict[str, float] = defaultdict(float)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.labels.get("model") == "tiny-sd" and sample.name.startswith("ray_raycluster_serve_"):
                    found[sample.name + sample.labels.get("outcome", "")] += sample.value
        return found

    assert wait_until(lambda: metrics()["ray_raycluster_serve_images_total"] >= made, 90), metrics()
    found = metrics()
    asked = 1 + 12 * len(doc["runs"])  # the test before's request of 4, then one image a request
    assert found["ray_raycluster_serve_image_requests_totalok"] >= asked
    assert found["ray_raycluster_serve_image_request_seconds_count"] >= asked
    assert wait_until(lambda: metrics()["ray_raycluster_serve_replicas_live"] == 3, 60), metrics()


def test_status_shows_the_image_service_and_serve_stop_removes_it(served: Served) -> None:
    code, doc, err = served.lab.cli("status")
    assert doc["service"]["serve"]["status"] == "RUNNING", (doc.get("service"), err[-2000:])
    assert doc["service"]["record"]["kind"] == "image" and doc["service"]["record"]["url"] == served.doc["url"]
    code, stopped, err = served.lab.cli("serve", "--stop", timeout=300)
    assert code == 0 and stopped["removed"] is True, err
