"""A request while the engine runs it, what a step's rows carry to the stages, and how a step that came back as
logits becomes each row's token.

A step's table (``step_inputs``) carries every row's slot, start and length, the every-position flag and its
sampling settings (``models.sampling``): the last stage samples with them and the step comes back as one token id
a row.  A row whose request needs the logits (their log-probabilities; penalties, a bias or a minimum length, which
read the token history held here) makes its step ship logits; ``pick_from_logits`` then draws every row of it with
the last stage's own ``sample_rows``, each from its logits as its request's processors leave them, so a row's
token is the same whichever side drew it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from raycluster_cli.models.sampling import (
    MODE_GREEDY,
    MODE_LOGITS,
    MODE_SAMPLE,
    MODE_SKIP,
    Params,
    RowSampling,
    sample_rows,
)
from raycluster_cli.serve.scheduler import Chunk
from raycluster_cli.serve.text import Sampling, TextStream, TokenLogprob, adjust, bad_logits, token_logprob

__all__ = [
    "BadInput", "EngineDown", "Live", "Output", "RequestFailed", "Resume", "pick_from_logits", "read_row",
    "step_inputs", "unsampleable",
]  # fmt: skip


class EngineDown(RuntimeError):
    """A stage failed: the engine answers no more requests (the service says 503)."""


class BadInput(ValueError):
    """A request the engine cannot run as given (a token outside the vocabulary, a seed outside 64 bits):
    refused before it is admitted (400 naming ``param``), so it never enters a step."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class RequestFailed(RuntimeError):
    """One request failed on its own (its row's logits are not numbers): only it ends, with this error (500);
    the pipeline and the other rows go on, and it is not moved to another pipeline (it would fail there too)."""


@dataclass(frozen=True)
class Output:
    """A piece of one request's result: new text, its tokens so far, and why it ended (None: not yet);
    ``logprobs``: the new token's log-probabilities when the request asked for them (one per output: an output
    follows each generated token, its text possibly held back for a while)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    prompt_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()
    # on a request's first output, when its sampling asked: each prompt token's log-probability from the second on
    # (the first has none: nothing comes before it)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Resume:
    """Where a request stood when its pipeline died: the tokens it generated, the characters sent."""

    tokens: tuple[int, ...]
    released: int


@dataclass
class Live:
    prompt: list[int]
    sampling: Sampling
    stream: TextStream
    seed: int  # the request's, or one drawn at admission: its tokens' draws are functions of it and their positions
    queue: asyncio.Queue[Output | BaseException] = field(default_factory=asyncio.Queue)
    prompt_scored: list[TokenLogprob] = field(default_factory=list)  # the prompt's logprobs, as its chunks return
    answered: bool = False  # its first output went out (the prompt's logprobs with it)
    failed: bool = False  # its own row failed (``RequestFailed`` handed over): later steps skip it

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    def wants_every_position(self, chunk: Chunk) -> bool:
        """Does this chunk need the logits of its every position: a chunk of the prompt (not a resumed
        request's generated tokens) whose log-probabilities were asked for, before they were sent (a preempted
        sequence prefills its prompt again, and its prompt's log-probabilities went with its first token)."""
        return self.sampling.prompt_logprobs and chunk.start < len(self.prompt) - 1 and not self.answered

    def row_sampling(self, chunk: Chunk) -> RowSampling:
        """How this chunk's row picks its token: on the last stage (greedy or drawn), or here from its logits
        when its request needs them (their log-probabilities, or processors that read the token history)."""
        s = self.sampling
        greedy = s.temperature == 0
        here = chunk.samples and (s.logprobs is not None or s.adjusts_logits)
        mode = MODE_LOGITS if here or self.wants_every_position(chunk) else MODE_GREEDY if greedy else MODE_SAMPLE
        if not chunk.samples and mode != MODE_LOGITS:
            return RowSampling(mode=MODE_SKIP)  # a prompt's chunk before its last: its token is never used
        temperature = 0.0 if greedy else s.temperature
        position = chunk.start + len(chunk.tokens)
        return RowSampling(temperature, s.top_p, s.min_p, s.top_k, self.seed, position, mode)


def step_inputs(
    chunks: Sequence[Chunk], every: Sequence[bool] = (), params: Params | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids right-padded to the longest chunk [B, T] and the (slot, start, length) table [3, B]; a fourth
    row when some row needs the logits of ``every`` position (the last stage then returns [B, T, vocab]); with
    ``params``, the fourth row always and the rows' sampling settings after it (``models.sampling.TABLE_ROWS``)."""
    width = max(len(c.tokens) for c in chunks)
    ids = torch.zeros(len(chunks), width, dtype=torch.long)
    for row, chunk in enumerate(chunks):
        ids[row, : len(chunk.tokens)] = torch.tensor(chunk.tokens, dtype=torch.long)
    columns = [[c.slot, c.start, len(c.tokens)] for c in chunks]
    if any(every) or params is not None:
        flags = every or [False] * len(chunks)
        columns = [[*column, int(flag)] for column, flag in zip(columns, flags, strict=True)]
    table = torch.tensor(columns, dtype=torch.long).T.contiguous()
    if params is not None:
        table = torch.cat([table, params.table()])
    return ids, table


def pick_from_logits(
    chunks: Sequence[Chunk],
    logits: torch.Tensor,
    params: Params,
    live: Mapping[str, Live],
    eos: frozenset[int],
    scored: dict[str, TokenLogprob],
) -> list[int | Exception]:
    """Each row's token from a step that came back as logits: the rows that sample, drawn together by the
    last stage's own ``sample_rows`` (a row's token is the same whichever side drew it), each from its logits
    as its request's processors leave them; its log-probabilities from the model's own."""
    picked: list[int | Exception] = [0] * len(chunks)
    rows: list[int] = []
    lasts: list[torch.Tensor] = []
    for row, chunk in enumerate(chunks):
        request = live.get(chunk.request_id)
        if request is None or request.failed:
            continue
        try:
            last = read_row(chunk, request, logits[row])
            if chunk.samples:
                adjusted = adjust(last, request.sampling, request.prompt, request.stream.ids, eos)
                rows.append(row)
                lasts.append(adjusted.float())
        except Exception as exc:  # this row's logits or its own settings: only its request fails
            picked[row] = exc
    if not rows:
        return picked
    drawn = sample_rows(torch.stack(lasts), params.select(torch.tensor(rows))).tolist()
    for row, token in zip(rows, drawn, strict=True):
        picked[row] = token
        top = live[chunks[row].request_id].sampling.logprobs
        if token >= 0 and top is not None:
            last = logits[row] if logits.dim() == 2 else logits[row, len(chunks[row].tokens) - 1]
            scored[chunks[row].request_id] = token_logprob(last, token, top)
    return picked


def read_row(chunk: Chunk, live: Live, logits: torch.Tensor) -> torch.Tensor:
    """One row of a step that came back as logits: ``logits`` [vocab] (its last position's) or [T, vocab]
    (every position's); its prompt's log-probabilities when asked.  Its last position's logits."""
    used = logits if logits.dim() == 1 else logits[: len(chunk.tokens)]
    why = bad_logits(used)
    if why is not None:
        raise unsampleable(chunk, why)
    if logits.dim() == 2 and live.wants_every_position(chunk):
        top = live.sampling.logprobs or 0
        for offset in range(len(chunk.tokens)):  # position p's logits score the prompt's token p + 1
            following = chunk.start + offset + 1
            if following < len(live.prompt):
                live.prompt_scored.append(token_logprob(logits[offset], live.prompt[following], top))
    return logits if logits.dim() == 1 else logits[len(chunk.tokens) - 1]


def unsampleable(chunk: Chunk, why: str) -> RequestFailed:
    return RequestFailed(
        f"the model's logits for this request hold {why} at position {chunk.start + len(chunk.tokens) - 1}:"
        " its weights or its input overflow; no token can be sampled"
    )
