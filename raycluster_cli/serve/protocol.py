"""The OpenAI API's shapes: request bodies (validated), responses, stream chunks and the error document.

Only what this service does is accepted: up to ``MAX_CHOICES`` choices (``n``), text or token-id prompts, plain
string chat content (or a list of text parts); images come back inline (``b64_json``, PNG), never as URLs.  Fields the service does not use are ignored, as
OpenAI-compatible servers do, so existing clients that send them still work.

Log-probabilities of the generated tokens are served in both shapes OpenAI has: a completion's ``logprobs: k``
(``tokens``, ``token_logprobs``, ``top_logprobs`` with the sampled token always among them, ``text_offset``) and
a chat completion's ``logprobs: true`` with ``top_logprobs: k`` (``content``: token, logprob, bytes and the k
best).  A completion's ``echo`` with ``logprobs`` also scores the prompt: its tokens come first in ``logprobs``,
the first with ``null`` (nothing precedes it), as OpenAI's completions did and evaluation harnesses read them.
"""

from __future__ import annotations

import codecs
import json
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from raycluster_cli.serve.tokenbytes import token_string

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, retry_after: int = 0
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = {"Retry-After": str(retry_after)} if retry_after else {}

    def body(self) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


MAX_CHOICES = 16  # a request's n: each choice is a generation of its own (its own KV slot)


class _Sampled(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # a 64-bit integer (vLLM's bounds)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)  # choice i of a seeded request uses seed + i
    # An extension (vLLM's name and meaning): generate exactly max_tokens, past the model's EOS, so a
    # benchmark's output lengths are the ones it asked for.  Stop strings still end the text.
    ignore_eos: bool = False
    # OpenAI's penalties and biases (text.adjust), and the extensions vLLM and llama.cpp take by these names
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> -100..100
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    top_k: int = Field(default=0, ge=-1)  # -1 or 0: every token (vLLM's -1 included)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    # how tokens become text, as vLLM's clients send them (text.TextStream)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()):  # "²" is a digit to str.isdigit, not to int()
                raise ValueError(f"{key!r} is not a token id")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"the bias of token {key} is {bias}: a bias is -100 to 100")
        return value

    def biases(self, vocab: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias), each id checked against the model's vocabulary."""
        pairs = tuple((int(key), float(bias)) for key, bias in (self.logit_bias or {}).items())
        for token, _ in pairs:
            if token >= vocab:
                raise APIError(
                    400, f"logit_bias: token {token} is not in the vocabulary (0-{vocab - 1})", param="logit_bias"
                )
        return pairs

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; completions allow 5 there, vLLM allows more


class CompletionRequest(_Sampled):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    @property
    def asked_logprobs(self) -> int | None:
        """None: no log-probabilities asked; k: the sampled token's and the k best."""
        return self.logprobs

    @property
    def asked_prompt_logprobs(self) -> bool:
        """``echo`` with ``logprobs``: the prompt's tokens' too (how evaluation harnesses score a text)."""
        return self.echo and self.logprobs is not None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            if len(value) != 1:
                raise ValueError("one prompt per request")
            return str(value[0])
        if not value:
            raise ValueError("the prompt is empty")
        return value  # type: ignore[return-value]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(str(part.get("text", "")) for part in self.content if part.get("type") == "text")


class ChatRequest(_Sampled):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return self

    @property
    def asked_logprobs(self) -> int | None:
        """None: no log-probabilities asked; k: the sampled token's and the k best."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def asked_prompt_logprobs(self) -> bool:
        """A chat echoes nothing."""
        return False


class ImageGenerationRequest(BaseModel):
    """``POST /v1/images/generations``.  OpenAI's ``prompt``, ``model``, ``n``, ``size`` and ``response_format``;
    ``seed``, ``num_inference_steps``, ``guidance_scale`` and ``negative_prompt`` are extensions (diffusers'
    names).  Image ``i`` of ``n`` is made with ``seed + i``, so each one equals diffusers' own pipeline run with
    that seed, whichever node made it.  ``quality``, ``style``, ``user`` … are ignored."""

    model_config = ConfigDict(extra="ignore")

    prompt: str = Field(min_length=1, max_length=4000)
    model: str | None = None
    n: int = Field(default=1, ge=1, le=10)
    size: str | None = None  # "WIDTHxHEIGHT"; None or "auto": the checkpoint's own size
    response_format: str | None = None  # b64_json (the default here); url is refused
    seed: int | None = Field(default=None, ge=0, le=2**63 - 11)
    num_inference_steps: int | None = Field(default=None, ge=1, le=10_000)  # the service's bound is the operator's
    guidance_scale: float | None = Field(default=None, ge=0.0, le=100.0)
    negative_prompt: str = Field(default="", max_length=4000)

    @field_validator("response_format")
    @classmethod
    def _inline_only(cls, value: str | None) -> str | None:
        if value == "url":
            raise ValueError(
                "'url' is not offered: this service keeps no image store to link to; ask for 'b64_json' (PNG inline)"
            )
        if value not in (None, "b64_json"):
            raise ValueError(f"{value!r} is not a response format; use 'b64_json'")
        return value

    def dimensions(self, default: int, multiple: int, largest: int) -> tuple[int, int]:
        """(width, height) from ``size``; a size that is not WxH, not a multiple of ``multiple`` or over
        ``largest`` is a 400 naming ``size``."""
        if self.size in (None, "auto"):
            return default, default
        width, sep, height = str(self.size).lower().partition("x")
        if not (sep and width.isdigit() and height.isdigit()):
            raise APIError(400, f"size {self.size!r} is not WIDTHxHEIGHT, e.g. '{default}x{default}'", param="size")
        w, h = int(width), int(height)
        if not (multiple <= w <= largest and multiple <= h <= largest) or w % multiple or h % multiple:
            raise APIError(
                400,
                f"size {self.size!r}: width and height must be multiples of {multiple} between {multiple} and "
                f"{largest} (this model's own size: {default}x{default})",
                param="size",
            )
        return w, h


def parse(model: type[BaseModel], body: bytes) -> Any:
    """The request body as ``model``, or a 400 naming the first bad field."""
    try:
        data = json.loads(body or b"null")
    except ValueError as exc:
        raise APIError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"{param}: {first['msg']}", param=param) from None


def model_card(model: str, created: int) -> dict[str, Any]:
    """One entry of ``/v1/models``, and ``/v1/models/{model}``'s answer."""
    return {"id": model, "object": "model", "created": created, "owned_by": "raycluster"}


def check_model(asked: str, served: str) -> None:
    """404 in OpenAI's shape (``model_not_found``) when a request names a model this service does not serve."""
    if asked != served:
        raise APIError(
            404,
            f"the model {asked!r} does not exist; this service serves {served!r}",
            param="model",
            code="model_not_found",
        )


def health(live: int, retry_after: int) -> dict[str, Any]:
    """``GET /health``'s answer: 200 while ``live`` replicas can generate, 503 with ``Retry-After`` while none can
    (a load balancer's or an orchestrator's probe; it says nothing else, so it asks for no key, as vLLM's, TGI's
    and llama.cpp's ``/health`` do).  "Live" is a replica whose every stage answered: a failed one is out of it."""
    if live < 1:
        raise APIError(503, "no replica can generate now", retry_after=retry_after)
    return {"status": "ok", "replicas": live}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(request_id: str, kind: str, model: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices, **extra}


def completion_choice(
    text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None, *, index: int = 0
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(
    text: str,
    finish_reason: str | None,
    *,
    delta: bool,
    first: bool = False,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    if not delta:
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    body: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
    return {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": finish_reason}


class Scored(Protocol):
    """A generated token's log-probability and the best alternatives ((id, logprob), best first)."""

    @property
    def token(self) -> int: ...
    @property
    def logprob(self) -> float: ...
    @property
    def top(self) -> tuple[tuple[int, float], ...]: ...


class Logprobs:
    """One choice's token log-probabilities in OpenAI's shape, a piece at a time: ``add`` the tokens' as they
    come, ``take`` those not yet given (a stream's chunk carries the tokens since the last chunk; a token whose
    text is still held back goes with the next one).  ``token_bytes`` gives a token's own bytes
    (``tokenbytes``), named by ``token_string``: distinct for distinct tokens, so ``top_logprobs`` keys never
    collide; ``offset``: where the first token's text starts in the choice's text (a completion's
    ``text_offset``, counted in characters: a token that ends inside a character is at that character)."""

    def __init__(self, token_bytes: Callable[[int], bytes], *, chat: bool, offset: int = 0) -> None:
        self.token_bytes, self.chat, self.offset = token_bytes, chat, offset
        self.pending: list[Scored | int] = []  # an int: a token with no log-probability (a prompt's first)
        self._chars = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, items: Sequence[Scored]) -> None:
        self.pending.extend(items)

    def add_prompt(self, prompt: Sequence[int], scored: Sequence[Scored]) -> None:
        """The echoed prompt's tokens, before any generated one: the first without a log-probability, then
        ``scored`` (each later prompt token's)."""
        if prompt:
            self.pending.extend([prompt[0], *scored])

    def _name(self, token: int) -> str:
        return token_string(self.token_bytes(token))

    def take(self) -> dict[str, Any] | None:
        items, self.pending = self.pending, []
        if self.chat:
            return {"content": [self._chat_entry(i) for i in items if not isinstance(i, int)]}
        ids = [i if isinstance(i, int) else i.token for i in items]
        offsets = []
        for token in ids:
            offsets.append(self.offset)
            self.offset += len(self._chars.decode(self.token_bytes(token)))
        tokens = [self._name(token) for token in ids]
        tops: list[dict[str, float] | None] = []
        for item, text in zip(items, tokens, strict=True):
            if isinstance(item, int):
                tops.append(None)
                continue
            best = {self._name(token): logprob for token, logprob in item.top}
            tops.append(best | {text: item.logprob})  # the sampled token is always there (OpenAI: up to k + 1)
        return {
            "tokens": tokens,
            "token_logprobs": [None if isinstance(i, int) else i.logprob for i in items],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _chat_entry(self, item: Scored) -> dict[str, Any]:
        def one(token: int, logprob: float) -> dict[str, Any]:
            data = self.token_bytes(token)
            return {"token": token_string(data), "logprob": logprob, "bytes": list(data)}

        return one(item.token, item.logprob) | {"top_logprobs": [one(t, lp) for t, lp in item.top]}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: {...}`` (or ``data: [DONE]``) and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
