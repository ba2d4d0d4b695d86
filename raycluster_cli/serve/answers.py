"""The answer's shape: a request's choices, whole (one JSON body) or streamed (server-sent events), with their
log-probabilities and usage, in OpenAI's form; each choice's sampling (the request's, per choice); and what a
generation's errors answer.

Kept apart from the routes (serve/app.py) so the HTTP shell only wires requests to the engine (serve/seam.py) and
every backend's outputs (``serve.engine.Output``) are shaped the same way.  Everything here works on outputs
already started: nothing in it knows the pool, the tokenizer or the keys.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from raycluster_cli.serve import protocol
from raycluster_cli.serve.engine import BadInput, EngineDown, Output, QueueFull, RequestFailed
from raycluster_cli.serve.protocol import APIError
from raycluster_cli.serve.text import Sampling

RETRY_AFTER_S = 2  # what a 503 asks the client to wait


@dataclass
class Choice:
    """One of a request's ``n`` generations: its first output (awaited before the answer starts), the rest, and
    its log-probabilities' accumulator when asked (holding the echoed prompt's entries from the start)."""

    first: Output
    rest: AsyncIterator[Output]
    logprobs: protocol.Logprobs | None = None


def choice_body(
    chat: bool, index: int, text: str, reason: str | None, scored: Any, *, delta: bool, first: bool = False
) -> dict[str, Any]:
    if chat:
        return protocol.chat_choice(text, reason, delta=delta, first=first, logprobs=scored, index=index)
    return protocol.completion_choice(text, reason, scored, index=index)


async def whole(request_id: str, model: str, choices: list[Choice], *, chat: bool, echo: str = "") -> dict[str, Any]:
    """The whole answer: every choice's text (after the echoed prompt, if asked), finish reason and
    log-probabilities; usage counts the prompt once and every choice's tokens."""

    async def collect(choice: Choice) -> tuple[str, Output]:
        text, last = echo + choice.first.text, choice.first
        if choice.logprobs is not None:
            choice.logprobs.add(choice.first.logprobs)
        async for out in choice.rest:
            text, last = text + out.text, out
            if choice.logprobs is not None:
                choice.logprobs.add(out.logprobs)
        return text, last

    tasks = [asyncio.ensure_future(collect(c)) for c in choices]
    try:
        done = await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # one choice failed (or the client left): the others stop generating for nobody
            task.cancel()
    bodies = [
        choice_body(chat, i, text, last.finish_reason, c.logprobs.take() if c.logprobs else None, delta=False)
        for i, (c, (text, last)) in enumerate(zip(choices, done, strict=True))
    ]
    kind = "chat.completion" if chat else "text_completion"
    generated = sum(len(last.token_ids) for _, last in done)
    return protocol.envelope(request_id, kind, model, bodies, usage=protocol.usage(done[0][1].prompt_tokens, generated))


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[int, Output]]:
    """Every choice's outputs as they come, tagged with its index (one choice: its own, in order).  A choice that
    fails ends the whole stream with its error; leaving early stops every choice's generation."""
    if len(choices) == 1:
        yield 0, choices[0].first
        async for out in choices[0].rest:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Output | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, choice: Choice) -> None:
        try:
            await queue.put((index, choice.first))
            async for out in choice.rest:
                await queue.put((index, out))
            await queue.put((index, None))
        except Exception as exc:  # the choice's generation failed: the stream ends with it
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(choices)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # the client left or a choice failed: the others' generations end (their slots freed)


async def failing_as_event(
    outputs: AsyncIterator[tuple[int, Output]],
) -> AsyncIterator[tuple[int, Output | dict[str, Any]]]:
    """The outputs, then, if the request failed after its answer began (its own row, or no pipeline left to
    move it to), one error in OpenAI's shape (``{"error": {...}}``, what the ``openai`` client raises from a
    stream) instead of a connection cut without a word."""
    try:
        async for item in outputs:
            yield item
    except (RequestFailed, EngineDown) as exc:
        status = 500 if isinstance(exc, RequestFailed) else 503
        yield 0, APIError(status, f"this request failed: {exc}").body()


async def stream_events(
    request_id: str,
    model: str,
    choices: list[Choice],
    *,
    chat: bool,
    include_usage: bool,
    echo: str = "",
) -> AsyncIterator[str]:
    """Server-sent events: each choice's echoed prompt if asked, one chunk per released piece of a choice's text
    (with the log-probabilities of its tokens since its last chunk, if asked; ``index`` names the choice), its
    finish reason, usage if asked (the prompt once, every choice's tokens), [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    last = [c.first for c in choices]
    sent = [0] * len(choices)
    if echo:
        for index, choice in enumerate(choices):  # with the prompt's log-probabilities, when asked
            taken = choice.logprobs.take() if choice.logprobs is not None else None
            body = protocol.completion_choice(echo, None, taken, index=index)
            yield protocol.sse(protocol.envelope(request_id, kind, model, [body]))
    async for index, out in failing_as_event(merged(choices)):
        if isinstance(out, dict):  # the stream's error: the client's library raises it
            yield protocol.sse(out)
            yield protocol.sse("[DONE]")
            return
        last[index] = out
        scored = choices[index].logprobs
        if scored is not None:
            scored.add(out.logprobs)
        if not out.text and out.finish_reason is None:
            continue
        taken = scored.take() if scored is not None else None
        body = choice_body(chat, index, out.text, out.finish_reason, taken, delta=True, first=sent[index] == 0)
        sent[index] += 1
        yield protocol.sse(protocol.envelope(request_id, kind, model, [body]))
    if include_usage:
        generated = sum(len(out.token_ids) for out in last)
        usage = protocol.usage(last[0].prompt_tokens, generated)
        yield protocol.sse(protocol.envelope(request_id, kind, model, [], usage=usage))
    yield protocol.sse("[DONE]")


async def released(events: AsyncIterable[Any], release: Callable[[], None]) -> AsyncIterator[Any]:
    """A streamed answer's events, then its key's count released, however the stream ends."""
    try:
        async for event in events:
            yield event
    finally:
        release()


def sampling(body: Any, index: int, biases: tuple[tuple[int, float], ...] = ()) -> Sampling:
    """Choice ``index``'s sampling: the request's, with ``seed + index`` when seeded (choice i of a seeded
    request is the same answer as a request of n = 1 with that seed)."""
    seed = None if body.seed is None else body.seed + index
    logprobs, prompt = body.asked_logprobs, body.asked_prompt_logprobs
    return Sampling(
        body.temperature,
        body.top_p,
        seed,
        body.ignore_eos,
        logprobs,
        prompt,
        top_k=max(0, body.top_k),
        min_p=body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=biases,
        min_tokens=body.min_tokens,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
    )


def choice_logprobs(
    token_bytes: Callable[[int], bytes], body: Any, chat: bool, echo: str, prompt: list[int], first: Output
) -> protocol.Logprobs | None:
    """A choice's log-probabilities' accumulator, None when not asked; an echoed prompt's entries go in first
    (from its first output), so the offsets start at the text's start."""
    if body.asked_logprobs is None:
        return None
    if not body.asked_prompt_logprobs:
        return protocol.Logprobs(token_bytes, chat=chat, offset=len(echo))
    scored = protocol.Logprobs(token_bytes, chat=chat)
    scored.add_prompt(prompt, first.prompt_logprobs)
    return scored


def refusal(exc: BaseException) -> BaseException:
    """What a generation that did not start answers: 503 (full, not ready), 400 (too long)."""
    if isinstance(exc, QueueFull):
        return APIError(503, f"the service is full ({exc}); retry later", retry_after=RETRY_AFTER_S)
    if isinstance(exc, EngineDown):
        return APIError(503, f"the service is not ready: {exc}", retry_after=RETRY_AFTER_S)
    if isinstance(exc, RequestFailed):
        return APIError(500, f"this request failed: {exc}")
    if isinstance(exc, BadInput):
        return APIError(400, f"{exc.param}: {exc}", param=exc.param)
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), param="max_tokens")
    return exc
