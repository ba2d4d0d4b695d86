"""The service on a throwaway local Ray, called by the real ``openai`` client, checked against ``transformers``.

A tiny random Llama with a real tokenizer is written by the test; the reference for every greedy
answer is ``transformers``' own ``generate(do_sample=False)`` on the same checkpoint and prompt.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
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
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

from raycluster_cli.host.containers import SERVE_ENV  # noqa: E402
from raycluster_cli.serve.app import build_app  # noqa: E402
from raycluster_cli.serve.scheduler import Limits  # noqa: E402
from raycluster_cli.serve.settings import ServeSettings  # noqa: E402

from ..local_ray import local_serve, write_keys  # noqa: E402
from ..openai_penalties import OpenAIPenalties  # noqa: E402
from ..serve_checkpoint import WORDS, write_chat_llama  # noqa: E402
from ..text_tokenizers import in_context  # noqa: E402

TOKEN = "rcs-test-service-key-default-0123456789"
CLUSTER_TOKEN = "0123456789abcdef" * 4  # the Ray cluster's token: never a key of the service
SERVICE_KEYS = {
    "default": TOKEN,
    "small": "rcs-test-key-small-0123456789abc",
    "gone": "rcs-test-key-revoked-0123456789",
}
MODEL = "tiny-chat-llama"
NEW_TOKENS = 12
# prompts of different lengths; the longest are fed in several prefill chunks of 8 tokens
PROMPTS = [
    " ".join(WORDS[(7 * i + j * 3) % len(WORDS)] for j in range(n))
    for i, n in enumerate((1, 3, 5, 9, 14, 20, 27, 33, 2, 17))
]


@dataclass
class Service:
    base_url: str
    path: Path
    tokenizer: Any
    model: Any
    keys: Path  # the service's keys document, re-read by the ingress when it changes

    def client(self, key: str = TOKEN) -> Any:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=180)

    def generate(self, ids: list[int], new_tokens: int = NEW_TOKENS) -> str:
        """What transformers itself answers, greedy."""
        out = self.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new_tokens)
        return in_context(self.tokenizer, ids, out[0, len(ids) :].tolist())


def _raw(url: str, body: bytes | None = None, token: str | None = TOKEN) -> tuple[int, dict[str, Any]]:
    """A plain HTTP call (no client library): the status and the JSON body."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    request = urllib.request.Request(url, data=body, headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _wait_ready(url: str, deadline_s: float = 60.0) -> None:
    """Poll the models route until the service answers 200 (no fixed sleep)."""
    began = time.monotonic()
    while True:
        try:
            if _raw(f"{url}/models")[0] == 200:
                return
        except (OSError, ValueError):
            pass
        if time.monotonic() - began > deadline_s:
            raise TimeoutError(f"{url} not ready after {deadline_s} s")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    path = write_chat_llama(tmp_path_factory.mktemp("serve") / MODEL)
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    write_keys(keys, SERVICE_KEYS, {"small": {"max_requests": 1}})
    cluster_token = keys.with_name("auth-token")  # what the nodes' Ray token file is; the service never takes it
    cluster_token.write_text(CLUSTER_TOKEN + "\n")
    settings = ServeSettings(
        model_path=str(path),
        keys_file=str(keys),
        stages=2,
        split=(2, 1),
        num_threads=1,
        limits=Limits(slots=8, step_tokens=48, prefill_chunk=8, max_seq=128, max_waiting=16),
    )
    # Serve as `up` sets it in the nodes' containers: the proxy calls the ingress over gRPC
    env = SERVE_ENV | {"RAY_AUTH_TOKEN_PATH": str(cluster_token)}
    with local_serve(build_app(settings, health_check_period_s=2), env) as root:
        url = f"{root}/v1"
        _wait_ready(url)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
        yield Service(url, path, tokenizer, model, keys)


async def _complete(client: Any, prompt: str, stream: bool, **extra: Any) -> tuple[str, Any]:
    """The text (joined stream chunks when streaming) and the usage of one completion."""
    args = {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0} | extra
    if not stream:
        answer = await client.completions.create(**args)
        return answer.choices[0].text, answer.usage
    pieces, usage = [], None
    async for chunk in await client.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        pieces += [c.text for c in chunk.choices]
        usage = chunk.usage or usage
    return "".join(pieces), usage


def test_concurrent_greedy_completions_equal_generate(service: Service) -> None:
    """24 requests at once (12 prompts, each streamed and not) on 8 KV slots: they join and leave the batch."""

    async def run() -> list[tuple[str, Any]]:
        client = service.client()
        calls = [_complete(client, p, stream) for p in PROMPTS for stream in (False, True)]
        return list(await asyncio.gather(*calls))

    answers = asyncio.run(run())
    for index, prompt in enumerate(PROMPTS):
        ids = service.tokenizer.encode(prompt)
        want = service.generate(ids)
        for text, usage in answers[2 * index : 2 * index + 2]:
            assert text == want, prompt
            assert usage.prompt_tokens == len(ids) and usage.completion_tokens == NEW_TOKENS
            assert usage.total_tokens == len(ids) + NEW_TOKENS


def test_chat_equals_generate_on_the_chat_template(service: Service) -> None:
    messages = [{"role": "system", "content": "one two"}, {"role": "user", "content": "hello world the cat"}]

    async def run() -> tuple[Any, str]:
        client = service.client()
        whole = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=NEW_TOKENS, temperature=0
        )
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=NEW_TOKENS, temperature=0, stream=True
        )
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        return whole, "".join(pieces)

    whole, streamed = asyncio.run(run())
    prompt = service.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = service.generate(service.tokenizer.encode(prompt, add_special_tokens=False))
    assert whole.choices[0].message.content == streamed == want
    assert whole.choices[0].message.role == "assistant"


def test_stop_string_ends_the_text_before_it(service: Service) -> None:
    prompt = PROMPTS[3]
    full = service.generate(service.tokenizer.encode(prompt))
    stop = " " + full.split(" ")[3]
    want = full[: full.index(stop)]

    async def run() -> list[Any]:
        client = service.client()
        whole = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stop=[stop]
        )
        return [whole, await _complete(client, prompt, True, stop=stop)]

    whole, (streamed, _) = asyncio.run(run())
    assert whole.choices[0].text == streamed == want
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens < NEW_TOKENS


def test_seeded_sampling_repeats_and_differs_from_greedy(service: Service) -> None:
    async def run() -> list[str]:
        client = service.client()
        calls = [_complete(client, PROMPTS[5], False, temperature=1.5, top_p=0.95, seed=s) for s in (7, 7, 8)]
        return [text for text, _ in await asyncio.gather(*calls)]

    first, again, other = asyncio.run(run())
    assert first == again
    assert {first, other} != {service.generate(service.tokenizer.encode(PROMPTS[5]))}


def test_penalties_biases_and_min_tokens_equal_transformers_generate(service: Service) -> None:
    """Greedy answers under each logit change equal transformers' ``generate`` with the same change (its own
    ``repetition_penalty``, ``sequence_bias`` and ``min_new_tokens``; OpenAI's penalties as a processor), whole and
    streamed, through the ``openai`` client's own parameters (and ``extra_body`` for vLLM's names); each answer
    differs from the plain greedy one, so a change the service ignored would fail here."""
    prompt = PROMPTS[4]
    ids = service.tokenizer.encode(prompt)
    eos = service.tokenizer.eos_token_id
    plain = service.generate(ids)

    def reference(**options: Any) -> tuple[str, int]:
        out = service.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS, **options)
        new = out[0, len(ids) :].tolist()
        return in_context(service.tokenizer, ids, new), len(new)

    lists = transformers.LogitsProcessorList
    cases: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
        "repetition": ({"extra_body": {"repetition_penalty": 1.6}}, {"repetition_penalty": 1.6}),
        "frequency": (
            {"frequency_penalty": 1.5, "presence_penalty": 0.5},
            {"logits_processor": lists([OpenAIPenalties(len(ids), 1.5, 0.5)])},
        ),
        "bias": ({"logit_bias": {str(ids[0]): 4.0}}, {"sequence_bias": {(ids[0],): 4.0}}),
        # EOS made the likeliest token: it ends the answer at once, unless min_tokens holds it off
        "min_tokens": (
            {"logit_bias": {str(eos): 60.0}, "extra_body": {"min_tokens": 5}},
            {"sequence_bias": {(eos,): 60.0}, "min_new_tokens": 5},
        ),
    }

    async def run() -> dict[str, list[tuple[str, Any]]]:
        client = service.client()
        calls = {
            name: [_complete(client, prompt, stream, **asked) for stream in (False, True)]
            for name, (asked, _) in cases.items()
        }
        got = await asyncio.gather(*(c for pair in calls.values() for c in pair))
        return {name: list(got[2 * i : 2 * i + 2]) for i, name in enumerate(cases)}

    answers = asyncio.run(run())
    for name, (_, options) in cases.items():
        want, length = reference(**options)
        assert want != plain, name  # the change changes the answer
        for text, usage in answers[name]:
            assert text == want, name
            assert usage.completion_tokens == length, name
    assert answers["min_tokens"][0][1].completion_tokens == 6  # five tokens, then the EOS


def test_top_k_one_and_min_p_one_sample_the_greedy_answer(service: Service) -> None:
    """At temperature 1.5 a seeded request samples; with top_k 1 or min_p 1 only the likeliest token is left."""
    prompt = PROMPTS[5]
    greedy = service.generate(service.tokenizer.encode(prompt))

    async def run() -> list[str]:
        client = service.client()
        sampled = {"temperature": 1.5, "seed": 11}
        calls = [
            _complete(client, prompt, False, **sampled),
            _complete(client, prompt, True, **sampled, extra_body={"top_k": 1}),
            _complete(client, prompt, False, **sampled, extra_body={"min_p": 1.0}),
        ]
        return [text for text, _ in await asyncio.gather(*calls)]

    free, top_k, min_p = asyncio.run(run())
    assert free != greedy
    assert top_k == min_p == greedy


def _model_logprobs(service: Service, prompt: list[int], tokens: list[int]) -> Any:
    """transformers' own log-softmax at each generated position [len(tokens), vocab]."""
    with torch.no_grad():
        logits = service.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_logprobs_are_the_models_own_whole_and_streamed(service: Service) -> None:
    """A completion's ``logprobs: 2`` and a streamed chat's ``logprobs`` + ``top_logprobs: 3``, read by the
    ``openai`` client: one entry per generated token, each the checkpoint's own log-probability (transformers'
    forward over prompt + answer) with its best alternatives; ``echo`` puts the prompt before the text."""
    prompt = PROMPTS[4]
    messages = [{"role": "user", "content": "the cat sat"}]

    async def run() -> tuple[Any, list[Any], Any]:
        client = service.client()
        whole = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, logprobs=2
        )
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=NEW_TOKENS,
            temperature=0,
            stream=True,
            logprobs=True,
            top_logprobs=3,
        )
        chunks = [c async for c in stream]
        echoed = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True)
        return whole, chunks, echoed

    whole, chunks, echoed = asyncio.run(run())
    ids = service.tokenizer.encode(prompt)
    choice = whole.choices[0]
    assert choice.text == service.generate(ids)
    scored = choice.logprobs
    assert len(scored.tokens) == len(scored.token_logprobs) == len(scored.top_logprobs) == NEW_TOKENS
    tokens = [service.tokenizer.convert_tokens_to_ids(t) for t in scored.tokens]
    expected = _model_logprobs(service, ids, tokens)
    for position, (token, logprob, top) in enumerate(
        zip(tokens, scored.token_logprobs, scored.top_logprobs, strict=True)
    ):
        assert logprob == pytest.approx(float(expected[position, token]), abs=1e-4)
        assert token == int(expected[position].argmax())  # greedy: the sampled token is the best
        assert len(top) == 2 and max(top.values()) == pytest.approx(logprob, abs=1e-6)
    assert scored.text_offset == sorted(scored.text_offset) and scored.text_offset[0] == 0

    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    template = service.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_ids = service.tokenizer.encode(template, add_special_tokens=False)
    assert text == service.generate(chat_ids)
    answer = [service.tokenizer.convert_tokens_to_ids(e.token) for e in entries]
    assert 0 < len(entries) <= NEW_TOKENS
    expected = _model_logprobs(service, chat_ids, answer)
    for position, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(float(expected[position, answer[position]]), abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token and len(entry.top_logprobs) == 3
        assert bytes(entry.bytes).decode() == entry.token

    assert echoed.choices[0].text == prompt + service.generate(ids, 4)


def test_an_echoed_prompt_is_scored_as_evaluation_harnesses_ask(service: Service) -> None:
    """lm-evaluation-harness's loglikelihood request: the prompt as token ids, ``echo``, ``logprobs: 1``,
    ``max_tokens: 1``, temperature 0.  Every prompt token after the first gets transformers' own log-probability
    (the first ``null``), then the generated one; streamed, the echo's chunk carries the prompt's."""
    ids = service.tokenizer.encode(PROMPTS[7])  # 33 words: fed in chunks of 8

    async def run() -> tuple[Any, list[Any]]:
        client = service.client()
        args = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
        whole = await client.completions.create(**args)
        chunks = [c async for c in await client.completions.create(**args, stream=True)]
        return whole, chunks

    whole, chunks = asyncio.run(run())
    scored = whole.choices[0].logprobs
    assert len(scored.token_logprobs) == len(ids) + 1 and scored.token_logprobs[0] is None
    assert scored.top_logprobs[0] is None and scored.text_offset[0] == 0
    assert [service.tokenizer.convert_tokens_to_ids(t) for t in scored.tokens[: len(ids)]] == ids
    expected = _model_logprobs(service, ids[:1], [*ids[1:], 0])  # position p scores token p + 1
    for position in range(1, len(ids)):
        assert scored.token_logprobs[position] == pytest.approx(float(expected[position - 1, ids[position]]), abs=1e-4)
    generated = service.tokenizer.convert_tokens_to_ids(scored.tokens[-1])
    assert scored.token_logprobs[-1] == pytest.approx(float(expected[len(ids) - 1, generated]), abs=1e-4)
    assert whole.choices[0].text.startswith(service.tokenizer.decode(ids, skip_special_tokens=True))
    streamed = [lp for c in chunks for choice in c.choices if (lp := choice.logprobs) is not None]
    assert streamed[0].token_logprobs == scored.token_logprobs[: len(ids)]
    assert sum(len(lp.tokens) for lp in streamed) == len(ids) + 1


def test_n_choices_are_each_their_own_generation_whole_and_streamed(service: Service) -> None:
    """``n`` choices: seeded, choice i is the answer of a request of n = 1 with seed + i; greedy, every choice is
    ``generate()``'s text, streamed too (chunks tagged by ``index``); usage counts the prompt once and every
    choice's tokens; a chat of n = 2 has two assistant messages."""
    prompt = PROMPTS[6]

    async def run() -> tuple[Any, list[str], list[Any], Any]:
        client = service.client()
        seeded = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=1.3, seed=40, n=3
        )
        singles = [
            await client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=1.3, seed=s)
            for s in (40, 41, 42)
        ]
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=NEW_TOKENS,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "the cat"}], max_tokens=4, temperature=0, n=2
        )
        return seeded, singles, chunks, chat

    seeded, singles, chunks, chat = asyncio.run(run())
    ids = service.tokenizer.encode(prompt)
    assert [c.index for c in seeded.choices] == [0, 1, 2]
    single_texts = [one.choices[0].text for one in singles]
    assert [c.text for c in seeded.choices] == single_texts and len(set(single_texts)) > 1
    assert seeded.usage.prompt_tokens == len(ids)
    assert seeded.usage.completion_tokens == sum(one.usage.completion_tokens for one in singles)
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    want = service.generate(ids)
    assert texts == [want, want]
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(ids) and usage.completion_tokens == 2 * NEW_TOKENS
    assert [c.message.role for c in chat.choices] == ["assistant", "assistant"]
    assert chat.choices[0].message.content == chat.choices[1].message.content


def _status(service: Service) -> dict[str, Any]:
    return _raw(service.base_url.removesuffix("/v1") + "/raycluster/status")[1]


@pytest.mark.parametrize("opt_out", [False, True], ids=["plain", "disconnect-disabled-header"])
def test_a_client_that_leaves_mid_stream_ends_its_generation(service: Service, opt_out: bool) -> None:
    """The client closes its connection after a few streamed chunks: Serve's proxy tells the ingress (over gRPC, as
    `up` sets it), the generation ends there and its slot is freed — the stages stepped far fewer times than the
    whole answer needed. Also for a client that asks the proxy not to watch its disconnect
    (``x-request-disconnect-disabled: ?1``): the proxy's guard drops that header (serve/proxy_guard.py)."""
    room = 128 - len(service.tokenizer.encode(PROMPTS[0])) - 1
    before = _status(service)["pipelines"][0]["stages"][0]["steps"]
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": room, "temperature": 0, "stream": True}
    host, port = service.base_url.removeprefix("http://").removesuffix("/v1").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
    if opt_out:
        headers["x-request-disconnect-disabled"] = "?1"
    connection.request("POST", "/v1/completions", json.dumps(body | {"ignore_eos": True}), headers)
    response = connection.getresponse()
    assert response.status == 200
    chunks = 0
    while chunks < 3:
        line = response.readline()
        assert line, f"the stream ended after {chunks} chunk(s), before the client left"  # EOF: no endless loop
        chunks += line.startswith(b"data: ")
    connection.close()  # the client leaves
    deadline = time.monotonic() + 30
    while _status(service)["pipelines"][0]["requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    status = _status(service)
    assert status["pipelines"][0]["requests"] == 0
    assert status["pipelines"][0]["stages"][0]["steps"] - before < room // 2


def test_errors_have_the_openai_shape(service: Service) -> None:
    async def run() -> None:
        with pytest.raises(openai.AuthenticationError):
            await service.client(key="wrong").models.list()
        with pytest.raises(openai.NotFoundError) as missing:
            await service.client().completions.create(model="no-such-model", prompt="the cat", max_tokens=2)
        assert missing.value.body["code"] == "model_not_found"
        with pytest.raises(openai.BadRequestError):
            await service.client().completions.create(model=MODEL, prompt="the cat", temperature=7)
        with pytest.raises(openai.BadRequestError) as top:  # top_logprobs means nothing without logprobs
            await service.client().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "the cat"}], top_logprobs=2
            )
        assert top.value.body["param"] == "top_logprobs"
        for bad, param in (
            ({"logit_bias": {"999999": 1.0}}, "logit_bias"),  # not in the vocabulary
            ({"logit_bias": {"3": 101.0}}, "logit_bias"),
            ({"presence_penalty": 2.5}, "presence_penalty"),
            ({"extra_body": {"min_tokens": 9}}, "min_tokens"),  # more than max_tokens
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                await service.client().completions.create(model=MODEL, prompt="the cat", max_tokens=4, **bad)
            assert refused.value.body["param"] == param, bad
        models = await service.client().models.list()
        assert [m.id for m in models.data] == [MODEL]

    asyncio.run(run())
    status, bare = _raw(f"{service.base_url}/completions", json.dumps({"model": MODEL, "prompt": "x"}).encode(), None)
    assert status == 401
    assert set(bare["error"]) == {"message", "type", "param", "code"}
    status, bad = _raw(f"{service.base_url}/completions", b"{")
    assert status == 400 and bad["error"]["type"] == "invalid_request_error"


def test_health_asks_no_key_and_a_model_is_retrieved_by_its_id(service: Service) -> None:
    """``GET /health`` (a load balancer's probe: no key) says the replicas that can generate; the ``openai``
    client's ``models.retrieve`` reads ``/v1/models/{id}`` (404 for another id, 401 without the key)."""
    status, body = _raw(service.base_url.removesuffix("/v1") + "/health", token=None)
    assert status == 200 and body == {"status": "ok", "replicas": 1}

    async def run() -> None:
        card = await service.client().models.retrieve(MODEL)
        assert card.id == MODEL and card.owned_by == "raycluster"
        with pytest.raises(openai.NotFoundError) as missing:
            await service.client().models.retrieve("no-such-model")
        assert missing.value.body["code"] == "model_not_found"
        with pytest.raises(openai.AuthenticationError):
            await service.client(key="wrong").models.retrieve(MODEL)

    asyncio.run(run())


def test_a_full_queue_answers_503_with_retry_after(service: Service) -> None:
    """8 slots + 16 waiting: of 40 long requests at once some are refused, the others complete."""

    async def run() -> list[Any]:
        client = service.client()
        calls = [
            client.completions.create(model=MODEL, prompt=PROMPTS[i % 4], max_tokens=40, temperature=0)
            for i in range(40)
        ]
        return list(await asyncio.gather(*calls, return_exceptions=True))

    results = asyncio.run(run())
    refused = [r for r in results if isinstance(r, openai.APIStatusError)]
    assert refused and all(r.status_code == 503 for r in refused)
    assert all(r.response.headers["retry-after"] for r in refused)
    assert all(r.body["type"] == "server_error" for r in refused)
    done = [r for r in results if not isinstance(r, BaseException)]
    assert len(done) + len(refused) == 40 and len(done) >= 24


def test_the_service_takes_its_own_keys_and_refuses_the_cluster_token(service: Service) -> None:
    """Every key of the keys document opens /v1; the Ray cluster's token (which opens the Jobs API) is refused by
    name; a key revoked in the document (rewritten, as `serve --keys revoke` does) is refused at the next request,
    without a restart; a key added the same way works at once."""
    for key in SERVICE_KEYS.values():
        assert _raw(f"{service.base_url}/models", token=key)[0] == 200
    status, body = _raw(f"{service.base_url}/models", token=CLUSTER_TOKEN)
    assert status == 401 and "Ray cluster's token" in body["error"]["message"]
    status, body = _raw(f"{service.base_url.removesuffix('/v1')}/raycluster/status", token=CLUSTER_TOKEN)
    assert status == 401
    added = "rcs-test-key-added-later-0123456789"
    kept = {k: v for k, v in SERVICE_KEYS.items() if k != "gone"}
    write_keys(service.keys, kept | {"later": added}, {"small": {"max_requests": 1}})
    try:
        assert _raw(f"{service.base_url}/models", token=SERVICE_KEYS["gone"])[0] == 401
        assert _raw(f"{service.base_url}/models", token=added)[0] == 200
        assert _raw(f"{service.base_url}/models", token=TOKEN)[0] == 200
    finally:
        write_keys(service.keys, SERVICE_KEYS, {"small": {"max_requests": 1}})
    assert _raw(f"{service.base_url}/models", token=SERVICE_KEYS["gone"])[0] == 200


def test_a_key_over_its_requests_in_flight_gets_429_and_its_count_returns(service: Service) -> None:
    """The key "small" may hold one request at once: a second beside a running stream gets 429 with Retry-After
    (the default key beside it is not limited); once the stream ends (and once a client leaves mid-stream) the
    key has its request back."""
    small = SERVICE_KEYS["small"]

    async def run() -> None:
        client = service.client(small)
        # a long stream (the whole context, past EOS), so it still runs while the second request arrives
        long = {"max_tokens": 110, "stream": True, "extra_body": {"ignore_eos": True}}
        stream = await client.completions.create(model=MODEL, prompt="the cat", **long)
        first = await anext(aiter(stream))
        assert first.choices
        with pytest.raises(openai.RateLimitError) as over:
            await client.completions.create(model=MODEL, prompt="the cat", max_tokens=2)
        assert over.value.response.headers["retry-after"] and over.value.body["code"] == "rate_limit_exceeded"
        other = await service.client().completions.create(model=MODEL, prompt="the cat", max_tokens=2)
        assert other.choices
        async for _ in stream:
            pass
        done = await client.completions.create(model=MODEL, prompt="the cat", max_tokens=2)
        assert done.choices
        left = await client.completions.create(model=MODEL, prompt="the cat", **long)
        await anext(aiter(left))
        await left.close()  # the client leaves mid-stream: the key's request is released with the stream

    asyncio.run(run())
    began = time.monotonic()
    while _status(service).get("keys_in_flight") and time.monotonic() - began < 10:
        time.sleep(0.1)
    assert _status(service).get("keys_in_flight") == {}


def test_no_schema_pages(service: Service) -> None:
    """No /docs, /redoc or /openapi.json, with or without a key: the service's surface is OpenAI's API."""
    root = service.base_url.removesuffix("/v1")
    for page in ("/docs", "/redoc", "/openapi.json"):
        assert _raw(root + page)[0] == 404, page
        assert _raw(root + page, token=None)[0] in (401, 404), page


def test_a_killed_stage_is_rebuilt_and_its_request_still_answers(service: Service) -> None:
    """Runs last: it kills the second stage's process.  The one pipeline is rebuilt by the ingress
    itself; a request that meets the dead pipeline waits for the new one (or, arriving while none
    serves, gets 503 with Retry-After) and then answers generate()'s text."""
    stages = [p for p in psutil.process_iter(["cmdline"]) if "ray::_StageActor" in " ".join(p.info["cmdline"] or [])]
    assert len(stages) == 2
    os.kill(stages[-1].pid, signal.SIGKILL)
    health = service.base_url.removesuffix("/v1") + "/health"
    began = time.monotonic()
    while (down := _raw(health, token=None))[0] == 200 and time.monotonic() - began < 20:
        time.sleep(0.05)  # the ring's link to the dead stage closes: the pipeline is out at once
    assert down[0] == 503 and down[1]["error"]["type"] == "server_error", down
    print(f"/health 503 {time.monotonic() - began:.2f} s after the kill")
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 4, "temperature": 0}).encode()
    statuses: list[int] = []
    began = time.monotonic()
    while time.monotonic() - began < 90:
        status, answer = _raw(f"{service.base_url}/completions", body)
        statuses.append(status)
        if status == 200:
            break
        assert status == 503 and answer["error"]["type"] == "server_error"
        time.sleep(0.2)
    assert statuses[-1] == 200
    assert answer["choices"][0]["text"] == service.generate(service.tokenizer.encode(PROMPTS[2]), 4)
    assert _raw(health, token=None) == (200, {"status": "ok", "replicas": 1})  # back with the rebuilt pipeline
