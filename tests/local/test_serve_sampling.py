"""Seeded sampling through the real service on a throwaway local Ray, over the ring of direct links and over Ray's
calls: the last stage samples (steps come back as token ids), and a seeded completion is the same tokens whichever
transport carried it and whatever else ran beside it; each equals ``transformers``' logits drawn by
``models.sampling`` at the same seed and positions, and a greedy one equals ``generate(do_sample=False)``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from raycluster_cli.host.containers import SERVE_ENV  # noqa: E402
from raycluster_cli.models.sampling import Params, RowSampling, sample_rows  # noqa: E402
from raycluster_cli.serve.app import build_app  # noqa: E402
from raycluster_cli.serve.scheduler import Limits  # noqa: E402
from raycluster_cli.serve.settings import ServeSettings  # noqa: E402

from ..local_ray import local_serve, write_keys  # noqa: E402
from ..serve_checkpoint import WORDS, write_chat_llama  # noqa: E402
from ..text_tokenizers import in_context  # noqa: E402
from .test_serve_openai import TOKEN, _raw, _wait_ready  # noqa: E402

MODEL = "tiny-chat-llama"
NEW_TOKENS = 10
SEEDED = {"temperature": 0.9, "top_p": 0.9, "seed": 1234, "ignore_eos": True}
PROMPT = " ".join(WORDS[:7])
OTHERS = [" ".join(WORDS[3 * i : 3 * i + 2 + i]) for i in range(1, 4)]


@dataclass
class Service:
    url: str
    links: str
    tokenizer: Any
    model: Any


ANSWERS: dict[str, str] = {}  # each transport's seeded answer: the same on both


@pytest.fixture(scope="module", params=["direct", "ray"])
def service(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    path = write_chat_llama(tmp_path_factory.mktemp(f"sampling-{request.param}") / MODEL)
    settings = ServeSettings(
        model_path=str(path),
        keys_file=write_keys(tmp_path_factory.mktemp("keys") / "keys.json", {"default": TOKEN}),
        stages=2,
        split=(2, 1),
        num_threads=1,
        links=request.param,
        limits=Limits(slots=4, step_tokens=32, prefill_chunk=8, max_seq=64, max_waiting=8),
    )
    with local_serve(build_app(settings, health_check_period_s=2), SERVE_ENV) as root:
        _wait_ready(f"{root}/v1")
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
        yield Service(f"{root}/v1", request.param, tokenizer, model)


def _complete(url: str, prompt: str, **sampling: Any) -> str:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, **sampling}).encode()
    status, answer = _raw(f"{url}/completions", body)
    assert status == 200, answer
    return str(answer["choices"][0]["text"])


def _drawn(service: Service, prompt: str) -> str:
    """``transformers``' logits at each position, the token drawn by ``models.sampling`` with the request's seed."""
    ids = service.tokenizer.encode(prompt)
    new: list[int] = []
    row = {"temperature": SEEDED["temperature"], "top_p": SEEDED["top_p"], "seed": SEEDED["seed"]}
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = service.model(torch.tensor([ids + new])).logits[0, -1].float()
            params = Params.of([RowSampling(**row, position=len(ids) + len(new), mode=1)])
            new.append(int(sample_rows(logits[None], params)[0]))
    return in_context(service.tokenizer, ids, new)


def test_seeded_completions_are_the_same_alone_beside_others_and_over_either_transport(service: Service) -> None:
    alone = _complete(service.url, PROMPT, **SEEDED)
    assert alone == _drawn(service, PROMPT)
    with ThreadPoolExecutor(4) as pool:
        beside = [pool.submit(_complete, service.url, other, temperature=1.0) for other in OTHERS]
        together = pool.submit(_complete, service.url, PROMPT, **SEEDED).result()
        assert all(isinstance(b.result(), str) for b in beside)
    assert together == alone
    ids = service.tokenizer.encode(PROMPT)
    greedy = service.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS)
    assert _complete(service.url, PROMPT, temperature=0) == in_context(
        service.tokenizer, ids, greedy[0, len(ids) :].tolist()
    )
    status, state = _raw(service.url.removesuffix("/v1") + "/raycluster/status")
    (pipeline,) = state["pipelines"]
    assert status == 200 and pipeline["links"] == service.links
    assert pipeline["steps_back"].get("ids", 0) > 0 and "logits" not in pipeline["steps_back"], pipeline
    ANSWERS[service.links] = alone
    assert len(set(ANSWERS.values())) == 1, ANSWERS
