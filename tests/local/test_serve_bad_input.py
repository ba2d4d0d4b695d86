"""A request's own bad input, sent beside a normal one to the service on a throwaway local Ray (real Ray Serve,
real stage actors, the real ``openai`` client): the bad one is refused or failed alone, the normal one gets
exactly ``transformers``' greedy answer, ``/health`` stays 200 and no failover or rebuild is counted.

The checkpoint is a tiny random Llama written by the test, with two real defects: its embedding has one row fewer
than its tokenizer's vocabulary (the last word's id is outside it), and one word's embedding row is NaN (its
logits, and every later position's of a prompt holding it, are NaN).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from raycluster_cli.host.containers import SERVE_ENV  # noqa: E402
from raycluster_cli.serve.app import build_app  # noqa: E402
from raycluster_cli.serve.frontdoor import RequestLimits  # noqa: E402
from raycluster_cli.serve.scheduler import Limits  # noqa: E402
from raycluster_cli.serve.settings import ServeSettings  # noqa: E402

from ..local_ray import local_serve  # noqa: E402
from ..serve_checkpoint import SPECIALS, WORDS, poison_embedding, write_chat_llama  # noqa: E402
from ..text_tokenizers import in_context  # noqa: E402

MODEL = "tiny-bad-input"
NEW_TOKENS = 10
GOOD = "the cat sat on a small red house by the river"
POISON = "fire"  # its embedding row is NaN
OUTSIDE = WORDS[-1]  # its id is the tokenizer's last: one past the embedding's rows
LIMITS = RequestLimits(body_bytes=32 * 1024, stop_strings=4, stop_chars=32, messages=8, scored_tokens=40)
MAX_SEQ = 128


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    path = write_chat_llama(tmp_path_factory.mktemp("bad") / MODEL, vocab_size=len(SPECIALS) + len(WORDS) - 1)
    poison_embedding(path, len(SPECIALS) + WORDS.index(POISON))
    settings = ServeSettings(
        model_path=str(path),
        stages=2,
        split=(2, 1),
        num_threads=1,
        limits=Limits(slots=4, step_tokens=48, prefill_chunk=8, max_seq=MAX_SEQ, max_waiting=16),
        request_limits=LIMITS,
        max_ongoing=6,  # the ingress holds 6 requests and Ray Serve queues 4 more: a flood past both gets 503s
        max_queued=4,
    )
    with local_serve(build_app(settings, health_check_period_s=2), SERVE_ENV) as url:
        deadline = time.monotonic() + 90
        while _raw(f"{url}/health")[0] != 200:
            assert time.monotonic() < deadline, "the service did not become healthy"
            time.sleep(0.3)
        yield url, path


def _raw(url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"} | (headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError:
        return 0, {}


def _greedy(path: Path, prompt: str) -> str:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    ids = tokenizer.encode(prompt)
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS)
    return in_context(tokenizer, ids, out[0, len(ids) :].tolist())  # as it reads after the prompt


def _client(url: str) -> Any:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _unharmed(url: str) -> None:
    """/health 200 and the pool never failed a pipeline over, nor rebuilt one."""
    assert _raw(f"{url}/health")[0] == 200
    status = _raw(f"{url}/raycluster/status")[1]
    assert status["failovers"] == 0 and status["rebuilding"] == 0, status["events"]
    assert [p["index"] for p in status["pipelines"]] == [0], status["events"]
    assert not [e for e in status["events"] if e["event"] in ("failover", "failed", "replaced")]


async def _beside(url: str, bad: dict[str, Any], *, stream: bool = False) -> tuple[str, BaseException]:
    """The good prompt and a bad request at once: the good one's text and the bad one's error."""
    client = _client(url)

    async def good() -> str:
        answer = await client.completions.create(model=MODEL, prompt=GOOD, max_tokens=NEW_TOKENS, temperature=0)
        return str(answer.choices[0].text)

    async def failing() -> None:
        if not stream:
            await client.completions.create(model=MODEL, max_tokens=NEW_TOKENS, temperature=0, **bad)
            return
        async for _ in await client.completions.create(
            model=MODEL, max_tokens=NEW_TOKENS, temperature=0, stream=True, **bad
        ):
            pass

    text, error = await asyncio.gather(good(), failing(), return_exceptions=True)
    assert isinstance(text, str) and isinstance(error, BaseException), (text, error)
    return text, error


@pytest.mark.parametrize("ids", [[999999999], [-5], [2**63], [7, 2**63 - 1]])
def test_token_ids_outside_the_vocabulary_are_a_400_and_harm_no_one(root: tuple[str, Path], ids: list[int]) -> None:
    url, path = root
    text, error = asyncio.run(_beside(url, {"prompt": ids}))
    assert isinstance(error, openai.BadRequestError), error
    assert error.body["param"] == "prompt" and "vocabulary" in error.body["message"]  # type: ignore[index]
    assert text == _greedy(path, GOOD)
    _unharmed(url)


def test_a_tokenizer_id_outside_the_embedding_is_a_400_naming_the_field(root: tuple[str, Path]) -> None:
    url, _ = root
    status, body = _raw(f"{url}/v1/completions", json.dumps({"model": MODEL, "prompt": f"a {OUTSIDE}"}).encode())
    assert status == 400 and body["error"]["param"] == "prompt" and "tokenizer" in body["error"]["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": OUTSIDE}]}
    status, body = _raw(f"{url}/v1/chat/completions", json.dumps(chat).encode())
    assert status == 400 and body["error"]["param"] == "messages"
    _unharmed(url)


@pytest.mark.parametrize("stream", [False, True])
def test_nan_logits_fail_their_request_alone(root: tuple[str, Path], stream: bool) -> None:
    """A prompt holding the NaN row's word: a 500 (whole) or an error event (stream) for it, the exact greedy
    answer for the request beside it, and the pipeline untouched."""
    url, path = root
    text, error = asyncio.run(_beside(url, {"prompt": f"the {POISON} is red"}, stream=stream))
    assert isinstance(error, openai.APIError), error
    if not stream:
        assert isinstance(error, openai.InternalServerError)
    assert "NaN" in str(error)
    assert text == _greedy(path, GOOD)
    _unharmed(url)


def test_a_seed_outside_64_bits_is_a_400_and_holds_no_slot(root: tuple[str, Path]) -> None:
    url, _ = root
    for seed in (2**63, 2**64, -(2**63) - 1) * 4:  # 3 x the slots
        body = {"model": MODEL, "prompt": GOOD, "max_tokens": 100, "seed": seed}
        status, answer = _raw(f"{url}/v1/completions", json.dumps(body).encode())
        assert status == 400 and answer["error"]["param"] == "seed", answer
    pipeline = _raw(f"{url}/raycluster/status")[1]["pipelines"][0]
    assert pipeline["outstanding_tokens"] == 0 and pipeline["requests"] == 0


@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        ("completions", {"prompt": GOOD, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("completions", {"prompt": GOOD, "stop": "x" * 33}, "stop"),
        ("completions", {"prompt": "the " * (MAX_SEQ * LIMITS.chars_per_token // 4 + 1)}, "prompt"),
        ("completions", {"prompt": GOOD, "n": 4, "echo": True, "logprobs": 1}, "n"),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 9}, "messages"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x" * (MAX_SEQ * 32 + 1)}]}, "messages"),
    ],
)
def test_each_request_limit_is_a_400_naming_its_field(
    root: tuple[str, Path], route: str, extra: dict[str, Any], param: str
) -> None:
    url, _ = root
    status, body = _raw(f"{url}/v1/{route}", json.dumps({"model": MODEL, "max_tokens": 2} | extra).encode())
    assert status == 400 and body["error"]["param"] == param, body


def test_a_body_over_its_limit_is_a_413_by_its_declared_length(root: tuple[str, Path]) -> None:
    url, _ = root
    big = json.dumps({"model": MODEL, "prompt": [7] * (LIMITS.body_bytes // 3)}).encode()
    status, body = _raw(f"{url}/v1/completions", big)
    assert status == 413 and body["error"]["param"] == "body" and str(LIMITS.body_bytes) in body["error"]["message"]
    _unharmed(url)


def test_a_flood_past_the_ingress_and_its_queue_gets_503_with_retry_after(root: tuple[str, Path]) -> None:
    """40 requests at once against an ingress that holds 6 and a queue of 4: the rest are refused at once with 503
    and Retry-After (Ray Serve's bounded queue, not a queue that grows), the others are answered whole, and the
    service is unharmed after.  How many are answered depends on how fast places free up while the flood arrives:
    at least the queue's 4 (all 40 at the same instant: CI saw exactly that), and more when early answers end
    before the last requests arrive (12 on a loaded machine); never all 40.
    """
    url, _ = root

    async def flood() -> list[Any]:
        client = _client(url)
        calls = [
            client.completions.create(
                model=MODEL, prompt=GOOD, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
            )
            for _ in range(40)
        ]
        return list(await asyncio.gather(*calls, return_exceptions=True))

    results = asyncio.run(flood())
    refused = [r for r in results if isinstance(r, openai.APIStatusError) and r.status_code == 503]
    done = [r for r in results if not isinstance(r, BaseException)]
    assert refused and all(r.response.headers.get("retry-after") for r in refused), results
    assert len(done) + len(refused) == 40 and 4 <= len(done) < 40, results
    assert all(r.usage.completion_tokens == 40 for r in done)
    _unharmed(url)
