"""The front door's bounds on one request (serve.frontdoor): a body refused by its size before it is parsed, counts
and lengths refused before tokenizing, the tokenizer off the event loop, the chat template stopped at its deadline."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request

from raycluster_cli.serve import protocol
from raycluster_cli.serve.frontdoor import (
    Overdue,
    RequestLimits,
    Tokenizing,
    check_counts,
    check_scored,
    check_text,
    read_body,
    within,
)
from raycluster_cli.serve.protocol import APIError, ChatRequest, CompletionRequest

LIMITS = RequestLimits(body_bytes=100, stop_strings=2, stop_chars=5, messages=3, scored_tokens=10)


def _request(pieces: list[bytes], length: str | None) -> Request:
    """A real ASGI request whose body arrives in ``pieces`` (``length``: its Content-Length header, if any)."""
    headers = [(b"content-length", length.encode())] if length is not None else []
    messages: Iterator[bytes] = iter(pieces)
    received: list[int] = []

    async def receive() -> dict[str, Any]:
        piece = next(messages, b"")
        received.append(len(piece))
        return {"type": "http.request", "body": piece, "more_body": bool(piece)}

    request = Request({"type": "http", "method": "POST", "headers": headers}, receive)
    request.state.received = received
    return request


def test_a_body_is_refused_by_its_declared_length_before_a_byte_is_read() -> None:
    request = _request([b"x" * 50] * 10, "500")
    with pytest.raises(APIError) as refused:
        asyncio.run(read_body(request, 100))
    assert refused.value.status == 413 and refused.value.param == "body"
    assert request.state.received == []


def test_a_body_without_a_length_or_lying_about_it_is_refused_as_it_arrives() -> None:
    for length in (None, "10"):
        request = _request([b"x" * 60] * 10, length)
        with pytest.raises(APIError) as refused:
            asyncio.run(read_body(request, 100))
        assert refused.value.status == 413 and len(request.state.received) == 2  # not the other eight pieces
    assert asyncio.run(read_body(_request([b"ab", b"cd"], "4"), 100)) == b"abcd"
    with pytest.raises(APIError) as bad:
        asyncio.run(read_body(_request([b"x"], "ten"), 100))
    assert bad.value.status == 400


def _parse(model: type, body: dict[str, Any]) -> Any:
    return protocol.parse(model, json.dumps({"model": "m"} | body).encode())


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [
        (CompletionRequest, {"prompt": "x", "stop": ["a", "b", "c"]}, "stop"),
        (CompletionRequest, {"prompt": "x", "stop": "toolong"}, "stop"),
        (ChatRequest, {"messages": [{"role": "user", "content": "x"}] * 4}, "messages"),
    ],
)
def test_counts_over_their_limits_are_a_400_naming_the_field(model: type, body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as refused:
        check_counts(_parse(model, body), LIMITS)
    assert refused.value.status == 400 and refused.value.param == param
    check_counts(_parse(model, body | {"stop": ["a", "b"]} | ({"messages": body["messages"][:3]} if "messages" in body else {})), LIMITS)  # fmt: skip


def test_a_text_too_long_for_any_tokens_and_too_many_scored_tokens_are_refused() -> None:
    check_text(16 * 32, 16, LIMITS, "prompt")
    with pytest.raises(APIError) as long:
        check_text(16 * 32 + 1, 16, LIMITS, "prompt")
    assert long.value.param == "prompt"
    echoed = _parse(CompletionRequest, {"prompt": "x", "n": 2, "echo": True, "logprobs": 0})
    check_scored(echoed, 5, LIMITS)
    with pytest.raises(APIError) as scored:
        check_scored(echoed, 6, LIMITS)
    assert scored.value.param == "n"
    check_scored(_parse(CompletionRequest, {"prompt": "x", "n": 2}), 6, LIMITS)  # no prompt scored: no bound


def test_a_chat_template_that_runs_past_its_deadline_is_interrupted(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from ..serve_checkpoint import write_chat_llama

    path = write_chat_llama(tmp_path / "ckpt", num_hidden_layers=1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = (
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    began = time.monotonic()
    with pytest.raises(Overdue):
        within(0.5, tokenizer.apply_chat_template, [{"role": "user", "content": "hi"}], tokenize=False)
    assert time.monotonic() - began < 5.0
    front = Tokenizing(tokenizer, RequestLimits(template_s=0.5))
    with pytest.raises(APIError) as refused:
        asyncio.run(front.chat([{"role": "user", "content": "hi"}]))
    assert refused.value.param == "messages" and "template_s" in refused.value.message
    front.close()


class _Witness:
    """A real tokenizer, and the thread each encode ran on."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.threads = tokenizer, []

    def encode(self, text: str, **options: Any) -> list[int]:
        self.threads.append(threading.get_ident())
        return list(self.tokenizer.encode(text, **options))


def test_tokenizing_runs_on_a_worker_thread_not_the_loop(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from ..serve_checkpoint import write_chat_llama

    path = write_chat_llama(tmp_path / "ckpt", num_hidden_layers=1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    witness = _Witness(tokenizer)
    front = Tokenizing(witness, LIMITS)

    async def run() -> tuple[list[int], int]:
        return await front.encode("the cat sat"), threading.get_ident()

    ids, loop_thread = asyncio.run(run())
    assert ids == tokenizer.encode("the cat sat")
    assert witness.threads and loop_thread not in witness.threads
    front.close()
