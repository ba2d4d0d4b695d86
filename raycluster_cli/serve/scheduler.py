"""Continuous batching: which sequences go into the next step, and what each step's tokens do to them.

Pure Python (no torch, no Ray), so its decisions are tested on their own.  The shape follows vLLM's
scheduler with chunked prefill: every step first gives each decoding sequence its one token, then
fills the rest of a token budget with prompt chunks of at most ``prefill_chunk`` tokens, so a long
prompt is fed over several steps while the decodes keep moving.  A request waiting for a KV slot is
admitted at the next step that finds one free; a sequence that ends (EOS, its token limit, the
context limit, or a stop string the engine saw) gives its slot back at once.  Several steps may be in
flight through the pipeline.  A decoding sequence is in at most one of them (its next token needs the step
before); a prompt's chunks go in consecutive steps without waiting for each other to come back (``scheduled``
runs ahead of ``computed``): the stages run a pipeline's steps in the order they were sent, so each stage writes
a chunk's KV cache before the next chunk reads it, and a prompt of k chunks costs one round trip and k - 1 steps
instead of k round trips.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace


class QueueFull(RuntimeError):
    """No room to wait: the service answers 503 with Retry-After."""


@dataclass
class SeqState:
    """One request's tokens and where they stand: ``computed`` of them are in its slot's KV cache."""

    request_id: str
    prompt: list[int]
    max_new_tokens: int
    slot: int = -1
    computed: int = 0  # tokens in the KV cache: of steps that came back
    scheduled: int = 0  # prompt tokens handed to steps (ahead of ``computed`` while chunks travel; at most the prompt)
    generated: list[int] = field(default_factory=list)
    in_flight: int = 0  # steps travelling with a chunk of this sequence
    finish_reason: str | None = None
    ignore_eos: bool = False

    @property
    def in_prefill(self) -> bool:
        return self.computed < len(self.prompt)

    @property
    def busy(self) -> bool:
        return self.in_flight > 0

    @property
    def prompt_left(self) -> int:
        """Prompt tokens not yet handed to a step."""
        return len(self.prompt) - self.scheduled


@dataclass(frozen=True)
class Chunk:
    """A sequence's part of one step: ``tokens`` fed at positions ``start``..; ``samples``: the step's
    output for this row is its next token (the last prompt chunk, every decode)."""

    request_id: str
    slot: int
    start: int
    tokens: tuple[int, ...]
    samples: bool


@dataclass(frozen=True)
class TokenEvent:
    """What a step did to one sequence: its new token (None for a prompt chunk that samples nothing)."""

    request_id: str
    token: int | None
    finish_reason: str | None


@dataclass(frozen=True)
class Limits:
    slots: int = 16  # KV cache slots: sequences running at once (a pipeline's: ``for_steps``)
    step_tokens: int = 256  # tokens per step (decodes + prompt chunks)
    prefill_chunk: int = 64  # prompt tokens of one sequence per step
    max_waiting: int = 256  # requests queued for a slot before new ones are refused
    max_seq: int = 512  # prompt + generated tokens of one sequence (the KV cache length)

    def for_steps(self, steps: int) -> Limits:
        """The limits of a pipeline that keeps ``steps`` steps in flight: ``slots`` sequences for each of them.

        A pipeline of S stages keeps S steps travelling (one on each stage), and the running sequences are
        shared among them: with ``slots`` in all, each step carries only slots / S rows, and a stage's step
        costs nearly as much for few rows as for many (its weights are read once per step).  Measured on
        the lab: 4.3 rows per step on 3 stages against 12 on one node, so the pipeline spent 1.5-1.9x the CPU per
        token.  vLLM's pipeline parallelism does the same: one scheduler of ``max_num_seqs`` per step in
        flight (its "virtual engines").  Each stage keeps the KV cache of its own blocks only (S x slots slots
        over an even 1/S of the blocks weigh what ``slots`` of the whole model do); the launcher's memory
        check counts S x slots rows."""
        if steps < 1:
            raise ValueError(f"steps in flight must be >= 1, got {steps}")
        return replace(self, slots=self.slots * steps)


class Scheduler:
    """Sequences waiting, running (holding a slot), and the steps that move them."""

    def __init__(self, limits: Limits, eos_ids: frozenset[int] = frozenset()) -> None:
        if min(limits.slots, limits.step_tokens, limits.prefill_chunk, limits.max_seq) < 1:
            raise ValueError(f"every limit must be >= 1: {limits}")
        self.limits = limits
        self.eos_ids = eos_ids
        self.waiting: deque[SeqState] = deque()
        self.running: dict[str, SeqState] = {}  # in admission order
        self.free_slots: list[int] = list(range(limits.slots - 1, -1, -1))

    def add(
        self,
        request_id: str,
        prompt: list[int],
        max_new_tokens: int,
        queue_limit: bool = True,
        ignore_eos: bool = False,
    ) -> None:
        """Queue a request; it joins the batch at the next step with a free slot.  Refused (``QueueFull``)
        when ``max_waiting`` requests already wait beyond the free slots, unless ``queue_limit`` is off
        (the health probe must not fail because clients filled the queue).  ``ignore_eos``: only the
        token limit (or the context) ends it."""
        if not prompt:
            raise ValueError("the prompt has no tokens")
        if max_new_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if len(prompt) + max_new_tokens > self.limits.max_seq:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_new_tokens}) exceed the context of"
                f" {self.limits.max_seq} tokens"
            )
        if queue_limit and len(self.waiting) >= self.limits.max_waiting + len(self.free_slots):
            raise QueueFull(f"{len(self.waiting)} requests are already waiting")
        self.waiting.append(SeqState(request_id, list(prompt), max_new_tokens, ignore_eos=ignore_eos))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def outstanding(self) -> int:
        """Work still to do, in tokens: prompt tokens not yet prefilled plus tokens still to generate, of
        every sequence waiting or running.  What the router balances on: a pipeline's queue in tokens
        says how long a new request would wait better than a count of requests of unequal lengths."""
        total = 0
        for seq in [*self.waiting, *self.running.values()]:
            if seq.finish_reason is None:
                total += max(0, len(seq.prompt) - seq.computed) + seq.max_new_tokens - len(seq.generated)
        return total

    @property
    def active(self) -> int:
        """Sequences that hold a slot or will get one at the next step."""
        return len(self.running) + min(len(self.waiting), len(self.free_slots))

    def schedule(self, max_rows: int = 0, max_tokens: int = 0) -> list[Chunk]:
        """The next step: every idle decoding sequence's token, then prompt chunks within the budget.

        ``max_rows`` (0: no cap) splits the sequences over several steps in flight, so that every stage
        of the pipeline has a step to work on instead of one step carrying them all.  ``max_tokens`` (0: the
        limits' ``step_tokens``) caps this step's tokens below that."""
        self._admit()
        budget = min(self.limits.step_tokens, max_tokens or self.limits.step_tokens)
        rows = max_rows or self.limits.slots
        chunks: list[Chunk] = []
        running = list(self.running.values())
        for seq in running:
            if not seq.busy and not seq.in_prefill and budget > 0 and len(chunks) < rows:
                chunks.append(Chunk(seq.request_id, seq.slot, seq.computed, (seq.generated[-1],), True))
                budget -= 1
        for seq in running:
            if seq.prompt_left > 0 and seq.finish_reason is None and budget > 0 and len(chunks) < rows:
                start = seq.scheduled
                size = min(self.limits.prefill_chunk, seq.prompt_left, budget)
                end = start + size
                chunks.append(
                    Chunk(seq.request_id, seq.slot, start, tuple(seq.prompt[start:end]), end == len(seq.prompt))
                )
                seq.scheduled = end
                budget -= size
        for chunk in chunks:
            self.running[chunk.request_id].in_flight += 1
        return chunks

    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            self.running[seq.request_id] = seq

    def complete(self, chunks: list[Chunk], tokens: dict[str, int]) -> list[TokenEvent]:
        """Apply a finished step: ``tokens`` holds the next token of every chunk that samples."""
        events: list[TokenEvent] = []
        for chunk in chunks:
            seq = self.running.get(chunk.request_id)
            if seq is None:  # aborted while its step was in flight
                continue
            seq.in_flight -= 1
            if seq.finish_reason is not None:  # finished while in flight: its slot can go once no step holds it
                if not seq.busy:
                    self._release(seq)
                continue
            seq.computed += len(chunk.tokens)
            if not chunk.samples:
                continue
            token = tokens[chunk.request_id]
            seq.generated.append(token)
            reason = self._finish_reason(seq, token)
            events.append(TokenEvent(seq.request_id, token, reason))
            if reason is not None:
                self.finish(seq.request_id, reason)
        return events

    def _finish_reason(self, seq: SeqState, token: int) -> str | None:
        if token in self.eos_ids and not seq.ignore_eos:
            return "stop"
        if len(seq.generated) >= seq.max_new_tokens or seq.computed + 1 >= self.limits.max_seq:
            return "length"
        return None

    def finish(self, request_id: str, reason: str) -> None:
        """End a sequence now (EOS, limit, stop string, client gone): its slot is free for the next step,
        or as soon as the step it is in comes back."""
        for queued in self.waiting:
            if queued.request_id == request_id:
                self.waiting.remove(queued)
                return
        seq = self.running.get(request_id)
        if seq is None:
            return
        seq.finish_reason = reason
        if not seq.busy:
            self._release(seq)

    def _release(self, seq: SeqState) -> None:
        del self.running[seq.request_id]
        self.free_slots.append(seq.slot)
