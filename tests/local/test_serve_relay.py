"""A pipeline whose steps go over Ray's calls (``--links ray``) on a throwaway local Ray, called over HTTP.

Its greedy answers are ``transformers``' own, and a stage that dies while no step is in flight is noticed at once:
the engine holds a call open on every stage, so ``/health`` says 503 until the pipeline is rebuilt.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
psutil = pytest.importorskip("psutil")

from raycluster_cli.host.containers import SERVE_ENV  # noqa: E402
from raycluster_cli.serve.app import build_app  # noqa: E402
from raycluster_cli.serve.scheduler import Limits  # noqa: E402
from raycluster_cli.serve.settings import ServeSettings  # noqa: E402

from ..local_ray import local_serve, write_keys  # noqa: E402
from ..serve_checkpoint import WORDS, write_chat_llama  # noqa: E402
from ..text_tokenizers import in_context  # noqa: E402
from .test_serve_openai import TOKEN, _raw, _wait_ready  # noqa: E402

MODEL = "tiny-chat-llama"
PROMPT = " ".join(WORDS[:6])


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any, Any]]:
    path = write_chat_llama(tmp_path_factory.mktemp("relay") / MODEL)
    settings = ServeSettings(
        model_path=str(path),
        keys_file=write_keys(tmp_path_factory.mktemp("keys") / "keys.json", {"default": TOKEN}),
        stages=2,
        split=(2, 1),
        num_threads=1,
        links="ray",
        limits=Limits(slots=4, step_tokens=32, prefill_chunk=8, max_seq=64, max_waiting=8),
    )
    with local_serve(build_app(settings, health_check_period_s=2), SERVE_ENV) as root:
        _wait_ready(f"{root}/v1")
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
        yield f"{root}/v1", tokenizer, model


def _greedy(tokenizer: Any, model: Any, new_tokens: int) -> str:
    ids = tokenizer.encode(PROMPT)
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new_tokens)
    return in_context(tokenizer, ids, out[0, len(ids) :].tolist())  # as it reads after the prompt


def test_a_relayed_stage_that_dies_idle_is_out_at_once_and_rebuilt(service: tuple[str, Any, Any]) -> None:
    url, tokenizer, model = service
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}).encode()
    status, answer = _raw(f"{url}/completions", body)
    assert status == 200 and answer["choices"][0]["text"] == _greedy(tokenizer, model, 6)
    status, state = _raw(url.removesuffix("/v1") + "/raycluster/status")
    assert [p["links"] for p in state["pipelines"]] == ["ray"]  # the steps really go over Ray's calls
    stages = [p for p in psutil.process_iter(["cmdline"]) if "ray::_StageActor" in " ".join(p.info["cmdline"] or [])]
    assert len(stages) == 2
    os.kill(stages[0].pid, signal.SIGKILL)  # no request in flight: nothing but the held call can notice
    health = url.removesuffix("/v1") + "/health"
    began = time.monotonic()
    while (down := _raw(health, token=None))[0] == 200 and time.monotonic() - began < 20:
        time.sleep(0.05)
    assert down[0] == 503, down
    print(f"/health 503 {time.monotonic() - began:.2f} s after the kill")
    while time.monotonic() - began < 90 and _raw(health, token=None)[0] != 200:
        time.sleep(0.2)
    status, answer = _raw(f"{url}/completions", body)
    assert status == 200 and answer["choices"][0]["text"] == _greedy(tokenizer, model, 6)
