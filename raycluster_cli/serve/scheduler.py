"""Continuous batching: which sequences go into the next step, and what each step's tokens do to them.

Pure Python (no torch, no Ray), so its decisions are tested on their own.  The shape follows vLLM's
scheduler with chunked prefill: every step first gives each decoding sequence its one token, then
fills the rest of a token budget with prompt chunks of at most ``prefill_chunk`` tokens, so a long
prompt is fed over several steps while the decodes keep moving; a step with no decode row gives its prompts the
whole budget.  A request waiting for a KV slot is
admitted at the next step that finds one free; a sequence that ends (EOS, its token limit, the
context limit, or a stop string the engine saw) gives its slot back at once.  Several steps may be in
flight through the pipeline.  A decoding sequence is in at most one of them (its next token needs the step
before); a prompt's chunks go in consecutive steps without waiting for each other to come back (``scheduled``
runs ahead of ``computed``): the stages run a pipeline's steps in the order they were sent, so each stage writes
a chunk's KV cache before the next chunk reads it, and a prompt of k chunks costs one round trip and k - 1 steps
instead of k round trips.

KV memory is counted in tokens, not slots (vLLM's blocks): a slot is only a row's place, with no memory behind it
while idle, and ``kv_tokens`` positions, in blocks of ``kv_block``, are shared by the running sequences.  A request
is admitted (first come, first served) when its prompt's blocks are free; a decoding sequence takes a block as it
passes the end of its last; when none is free the most recently admitted sequence is preempted by recompute: its
blocks go back and it waits at the head of the queue with its prompt and the tokens it generated as what must be
prefilled again (a failover's resume, ``serve.engine.Resume``: its stream to the client goes on untouched).
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
    blocks: int = 0  # KV blocks held (``Limits.kv_block`` positions each)
    began: bool = False  # a chunk at position 0 went out: the stages hold a sequence of this one in its slot

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
    slots: int = 16  # rows at once: sequences running (a pipeline's: ``for_steps``); no memory behind an idle one
    step_tokens: int = 256  # tokens per step (decodes + prompt chunks)
    prefill_chunk: int = 64  # prompt tokens of one sequence in a step with decode rows (without: the step's budget)
    max_waiting: int = 256  # requests queued for a slot before new ones are refused
    max_seq: int = 512  # prompt + generated tokens of one sequence (the KV cache length)
    kv_tokens: int = 0  # KV positions shared by the running sequences (0: slots x max_seq, every slot full)
    kv_block: int = 64  # positions a sequence's KV grows by (models.kvcache.KV_BLOCK)

    @property
    def kv_budget(self) -> int:
        """The KV positions the running sequences share: whole blocks of ``kv_block`` (without ``kv_tokens``,
        enough for every slot at ``max_seq``)."""
        if self.kv_tokens:
            return self.kv_tokens // self.kv_block * self.kv_block
        return self.slots * -(-self.max_seq // self.kv_block) * self.kv_block

    def for_steps(self, steps: int) -> Limits:
        """The limits of a pipeline that keeps ``steps`` steps in flight: ``slots`` sequences for each of them.

        A pipeline of S stages keeps S steps travelling (one on each stage), and the running sequences are
        shared among them: with ``slots`` in all, each step carries only slots / S rows, and a stage's step
        costs nearly as much for few rows as for many (its weights are read once per step).  Measured on
        the lab: 4.3 rows per step on 3 stages against 12 on one node, so the pipeline spent 1.5-1.9x the CPU per
        token.  vLLM's pipeline parallelism does the same: one scheduler of ``max_num_seqs`` per step in
        flight (its "virtual engines").  Each stage keeps the KV cache of its own blocks only (S x slots slots
        over an even 1/S of the blocks weigh what ``slots`` of the whole model do); the launcher's memory
        check counts S x slots rows (and S x ``kv_tokens``)."""
        if steps < 1:
            raise ValueError(f"steps in flight must be >= 1, got {steps}")
        return replace(self, slots=self.slots * steps, kv_tokens=self.kv_tokens * steps)


class Scheduler:
    """Sequences waiting, running (holding a slot), and the steps that move them."""

    def __init__(self, limits: Limits, eos_ids: frozenset[int] = frozenset()) -> None:
        if min(limits.slots, limits.step_tokens, limits.prefill_chunk, limits.max_seq, limits.kv_block) < 1:
            raise ValueError(f"every limit must be >= 1: {limits}")
        if limits.kv_budget < 1:
            raise ValueError(f"the KV budget ({limits.kv_tokens} tokens) holds no block of {limits.kv_block}")
        self.limits = limits
        self.eos_ids = eos_ids
        self.waiting: deque[SeqState] = deque()
        self.running: dict[str, SeqState] = {}  # in admission order
        self.free_slots: list[int] = list(range(limits.slots - 1, -1, -1))
        self.free_blocks = limits.kv_budget // limits.kv_block
        self.preemptions = 0
        self.begun = [0] * limits.slots  # sequences begun in each slot (chunks at position 0 sent), as a stage counts
        self.released: list[tuple[int, int]] = []  # (slot, begun) of sequences ended since the engine last looked

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
        if len(prompt) + max_new_tokens > self.limits.kv_budget:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_new_tokens}) exceed the KV cache budget of"
                f" {self.limits.kv_budget} tokens: ask for fewer max_tokens"
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
        for seq in list(self.running.values()):
            if seq.busy or seq.in_prefill or budget <= 0 or len(chunks) >= rows:
                continue
            if seq.request_id in self.running and self._grow(seq, seq.computed + 1, chunks):
                chunks.append(Chunk(seq.request_id, seq.slot, seq.computed, (seq.generated[-1],), True))
                budget -= 1
        # a prompt's chunk is capped beside decode rows (each costs the decoding streams a token's delay); a step of
        # prompts alone gives them its whole budget, first come first: a 1 024-token prompt alone is 4 steps of 256
        # tokens, not 16 of 64 (each product then streams the weights for 256 rows at once, not 64)
        cap = self.limits.prefill_chunk if chunks else budget
        for seq in list(self.running.values()):
            if seq.prompt_left > 0 and seq.finish_reason is None and budget > 0 and len(chunks) < rows:
                start = seq.scheduled
                size = min(cap, seq.prompt_left, budget)
                end = start + size
                chunks.append(
                    Chunk(seq.request_id, seq.slot, start, tuple(seq.prompt[start:end]), end == len(seq.prompt))
                )
                seq.scheduled = end
                budget -= size
        for chunk in chunks:
            seq = self.running[chunk.request_id]
            seq.in_flight += 1
            if chunk.start == 0:
                self.begun[chunk.slot] += 1
                seq.began = True
        return chunks

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.limits.kv_block)

    def _grow(self, seq: SeqState, tokens: int, chunks: list[Chunk]) -> bool:
        """Blocks for ``tokens`` positions of ``seq``, preempting the most recently admitted sequences that no
        step holds (``seq`` itself when it is the most recent) while none is free.  False: ``seq`` does not run
        in this step (preempted, or waiting for a step in flight to give blocks back)."""
        need = self._blocks_for(tokens) - seq.blocks
        while need > self.free_blocks:
            stepping = {c.request_id for c in chunks}
            victims = [v for v in self.running.values() if not v.busy and v.request_id not in stepping]
            if not victims:
                return False
            victim = victims[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.free_blocks -= max(0, need)
        seq.blocks += max(0, need)
        return True

    def preempt(self, seq: SeqState) -> None:
        """Free a running sequence's slot and blocks (no step may hold it) and put it at the head of the queue
        with everything it has as its prompt: it is prefilled again when blocks are free, and its next token
        follows the ones it generated."""
        if seq.busy:
            raise ValueError(f"{seq.request_id} has a step in flight: it cannot be preempted now")
        self._release(seq)
        seq.prompt = seq.prompt + seq.generated
        seq.max_new_tokens -= len(seq.generated)
        seq.generated = []
        seq.computed = seq.scheduled = 0
        seq.slot, seq.began = -1, False
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def kv_status(self) -> dict[str, int]:
        """What the service's status shows of the KV cache: its budget and the positions held, in tokens, and
        the sequences preempted so far."""
        return {
            "kv_tokens": self.limits.kv_budget,
            "kv_used_tokens": self.kv_used_tokens,
            "preemptions": self.preemptions,
        }

    def _admit(self) -> None:
        """First come, first served: the queue's head joins when a slot and its prompt's blocks are free."""
        while self.waiting and self.free_slots:
            need = self._blocks_for(len(self.waiting[0].prompt))
            if need > self.free_blocks:
                return
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            seq.blocks = need
            self.free_blocks -= need
            self.running[seq.request_id] = seq

    @property
    def kv_used_tokens(self) -> int:
        """KV positions held by the running sequences (whole blocks)."""
        return self.limits.kv_budget - self.free_blocks * self.limits.kv_block

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
        self.free_blocks += seq.blocks
        seq.blocks = 0
        if seq.began:
            self.released.append((seq.slot, self.begun[seq.slot]))

    def take_released(self) -> list[tuple[int, int]]:
        """(slot, sequences begun in it) of the sequences ended since the last call, for the stages to free
        their memory (``models.batched.BatchedStage.release``)."""
        released, self.released = self.released, []
        return released
