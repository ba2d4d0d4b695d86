"""Log-probabilities in OpenAI's two shapes, and the requests that ask for them or for several choices (pure: no
model, no Ray)."""

from __future__ import annotations

import json

import pytest

from raycluster_cli.serve import protocol
from raycluster_cli.serve.protocol import APIError, ChatRequest, CompletionRequest, Logprobs
from raycluster_cli.serve.text import TokenLogprob

NAMES = {1: "the", 2: " cat", 3: " sat", 4: "</s>"}


def _decode(token: int) -> bytes:
    return NAMES[token].encode()


def _parse(model: type, body: dict) -> object:
    return protocol.parse(model, json.dumps(body).encode())


def test_a_completion_gets_tokens_their_logprobs_the_best_with_the_sampled_and_offsets() -> None:
    scored = Logprobs(_decode, chat=False, offset=4)  # after an echoed prompt of 4 characters
    scored.add([TokenLogprob(1, -0.5, ((1, -0.5), (2, -1.5)))])
    first = scored.take()
    scored.add([TokenLogprob(2, -2.0, ((3, -0.3),)), TokenLogprob(3, -0.1, ((3, -0.1),))])
    second = scored.take()
    assert first == {
        "tokens": ["the"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{"the": -0.5, " cat": -1.5}],
        "text_offset": [4],
    }
    # the sampled token (" cat", not among the 1 best) is added to its position's top_logprobs: up to k + 1
    assert second is not None
    assert second["top_logprobs"] == [{" sat": -0.3, " cat": -2.0}, {" sat": -0.1}]
    assert second["text_offset"] == [7, 11]  # offsets run on across a stream's chunks
    assert scored.take() == {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def test_a_chat_completion_gets_content_entries_with_bytes_and_top_logprobs() -> None:
    scored = Logprobs(_decode, chat=True)
    scored.add([TokenLogprob(2, -1.25, ((3, -0.5), (2, -1.25)))])
    assert scored.take() == {
        "content": [
            {
                "token": " cat",
                "logprob": -1.25,
                "bytes": list(b" cat"),
                "top_logprobs": [
                    {"token": " sat", "logprob": -0.5, "bytes": list(b" sat")},
                    {"token": " cat", "logprob": -1.25, "bytes": list(b" cat")},
                ],
            }
        ]
    }


def test_an_echoed_prompt_comes_first_its_first_token_without_a_logprob() -> None:
    scored = Logprobs(_decode, chat=False)
    scored.add_prompt([1, 2], [TokenLogprob(2, -3.0, ((1, -0.2),))])
    scored.add([TokenLogprob(3, -0.7, ())])
    assert scored.take() == {
        "tokens": ["the", " cat", " sat"],
        "token_logprobs": [None, -3.0, -0.7],
        "top_logprobs": [None, {"the": -0.2, " cat": -3.0}, {" sat": -0.7}],
        "text_offset": [0, 3, 7],
    }


def test_what_each_request_asks_for() -> None:
    base = {"model": "m", "prompt": "a b"}
    assert _parse(CompletionRequest, base).n == 1 and _parse(CompletionRequest, base | {"n": 16}).n == 16  # type: ignore[attr-defined]
    assert _parse(CompletionRequest, base).asked_logprobs is None  # type: ignore[attr-defined]
    assert _parse(CompletionRequest, base | {"logprobs": 0}).asked_logprobs == 0  # type: ignore[attr-defined]
    assert not _parse(CompletionRequest, base | {"echo": True}).asked_prompt_logprobs  # type: ignore[attr-defined]
    echoed = _parse(CompletionRequest, base | {"echo": True, "logprobs": 1})
    assert echoed.asked_prompt_logprobs and echoed.asked_logprobs == 1  # type: ignore[attr-defined]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert _parse(ChatRequest, chat).asked_logprobs is None  # type: ignore[attr-defined]
    assert _parse(ChatRequest, chat | {"logprobs": True}).asked_logprobs == 0  # type: ignore[attr-defined]
    assert _parse(ChatRequest, chat | {"logprobs": True, "top_logprobs": 5}).asked_logprobs == 5  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [
        (CompletionRequest, {"model": "m", "prompt": "a", "logprobs": 21}, "logprobs"),
        (CompletionRequest, {"model": "m", "prompt": "a", "logprobs": -1}, "logprobs"),
        (CompletionRequest, {"model": "m", "prompt": "a", "n": 17}, "n"),
        (ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        (
            ChatRequest,
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        (
            ChatRequest,
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 99},
            "top_logprobs",
        ),
    ],
)
def test_a_request_the_service_cannot_answer_truly_is_a_400_naming_the_field(
    model: type, body: dict, param: str
) -> None:
    with pytest.raises(APIError) as caught:
        _parse(model, body)
    assert caught.value.status == 400 and caught.value.param == param
