"""The front door: what one request may weigh before any of its work is done, and that work kept off the loop.

The ingress's event loop drives every pipeline (each step's hand-back, sampling, every stream's text), so what a
single request costs there is what every other request waits.  Before parsing, a body is refused by its size
(``Content-Length``, then while it is read); after parsing, its counts (stop strings, messages) and its text's
length, still before any tokenizing; the tokenizer and the chat template then run on worker threads, the template
under a deadline that interrupts it.  Each limit is a field of ``RequestLimits`` (``ServeSettings.request_limits``)
with a default sized to the service's own contexts, so an operator may raise it; each refusal names the field.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

from raycluster_cli.serve.protocol import APIError

T = TypeVar("T")
MIB = 1 << 20


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one request.  Why these defaults:

    ``body_bytes``: 4 MiB.  The largest prompt a served context takes (128k tokens) is under 1 MiB as a list of
    token ids (at most 7 bytes an id) and about 0.5 MiB as text (4 characters a token): 4x room, while a body of
    10 MiB held the loop 15 s in tokenizing alone.  ``chars_per_token``: a text prompt (or the chat's messages)
    longer than ``max_seq`` x 32 characters cannot fit the context (real text averages 3-5 characters a token),
    so it is refused without tokenizing it.  ``stop_strings`` / ``stop_chars``: every generated token searches
    the text for each stop string (100 000 of them cost 25 ms a token); OpenAI takes 4, evaluation harnesses send
    a few short ones.  ``messages``: a chat's turns, each rendered by the template.  ``scored_tokens``: an echoed
    prompt's log-probabilities are a log-softmax over the vocabulary for each prompt token of each choice, on the
    loop: ``n`` x prompt tokens at most this.  ``template_s``: how long the chat template may render."""

    body_bytes: int = 4 * MIB
    chars_per_token: int = 32
    stop_strings: int = 16
    stop_chars: int = 256
    messages: int = 2048
    scored_tokens: int = 4096
    template_s: float = 5.0


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        413, f"the body has {size} bytes or more; at most {limit} (request_limits.body_bytes)", param="body"
    )


async def read_body(request: Any, limit: int) -> bytes:
    """The request's body, refused (413) once it is over ``limit`` bytes: by its ``Content-Length`` before any
    byte is read, else as it arrives (a chunked body, or a declared length that lies)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise APIError(400, f"Content-Length {declared!r} is not a number of bytes", param="body")
        if int(declared) > limit:
            raise _too_large(int(declared), limit)
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise _too_large(len(body), limit)
    return bytes(body)


def check_counts(body: Any, limits: RequestLimits) -> None:
    """Stop strings' count and length, and a chat's message count: 400 naming the field."""
    stops: Sequence[str] = body.stops
    if len(stops) > limits.stop_strings:
        raise APIError(400, f"stop: {len(stops)} strings; at most {limits.stop_strings}", param="stop")
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.stop_chars:
        raise APIError(400, f"stop: a string of {longest} characters; at most {limits.stop_chars}", param="stop")
    messages = getattr(body, "messages", None)
    if messages is not None and len(messages) > limits.messages:
        raise APIError(400, f"messages: {len(messages)} messages; at most {limits.messages}", param="messages")


def check_text(chars: int, max_seq: int, limits: RequestLimits, param: str) -> None:
    """A text too long for the context whatever its tokens (``chars_per_token`` a token at most): refused
    before the tokenizer sees it."""
    most = max_seq * limits.chars_per_token
    if chars > most:
        raise APIError(
            400,
            f"{param}: {chars} characters cannot fit the context of {max_seq} tokens (at most {most} characters)",
            param=param,
        )


def check_scored(body: Any, prompt_tokens: int, limits: RequestLimits) -> None:
    """An echoed prompt's log-probabilities are computed for each choice: ``n`` x its tokens at most
    ``scored_tokens``."""
    if body.asked_prompt_logprobs and body.n * prompt_tokens > limits.scored_tokens:
        raise APIError(
            400,
            f"n: {body.n} choices x {prompt_tokens} prompt tokens to score (echo with logprobs) is more than"
            f" {limits.scored_tokens}; ask fewer choices or a shorter prompt",
            param="n",
        )


class Overdue(TimeoutError):
    """A call ran past its deadline and was interrupted."""


def within(seconds: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on this thread, interrupted (``Overdue``) once it runs ``seconds``: a trace
    function on this thread looks at the clock at every line of Python it runs (a chat template is compiled
    Python: a loop of a billion turns is stopped too).  Only this thread is traced, and only during the call."""
    deadline = time.monotonic() + seconds

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise Overdue(f"still running after {seconds:g} s")
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        return fn(*args, **kwargs)
    finally:
        sys.settrace(previous)


class Tokenizing:
    """The tokenizer's work on worker threads (the loop goes on meanwhile): a fast tokenizer encodes in Rust
    without the GIL, a chat template renders under ``template_s``.  Two workers: one long prompt does not hold
    up every other request's."""

    def __init__(self, tokenizer: Any, limits: RequestLimits, workers: int = 2) -> None:
        self.tokenizer, self.limits = tokenizer, limits
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, lambda: fn(*args, **kwargs))

    async def encode(self, text: str, **options: Any) -> list[int]:
        return [int(t) for t in await self._run(self.tokenizer.encode, text, **options)]

    async def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat template's prompt, tokenized: 400 naming ``messages`` when the template refuses them or
        runs past ``template_s``."""
        try:
            text = await self._run(
                within,
                self.limits.template_s,
                self.tokenizer.apply_chat_template,
                messages,
                add_generation_prompt=True,
                tokenize=False,
            )
        except Overdue as exc:
            raise APIError(
                400, f"messages: the chat template {exc} (request_limits.template_s)", param="messages"
            ) from None
        except Exception as exc:  # a template that refuses these messages (roles, order)
            raise APIError(400, f"the chat template refused the messages: {exc}", param="messages") from None
        return await self.encode(str(text), add_special_tokens=False)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
