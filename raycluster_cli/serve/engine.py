"""The engine: requests in, token-by-token text out, continuously batched through the stage actors.

One asyncio loop owns the scheduler.  Whenever fewer than ``max_in_flight`` steps are travelling
through the pipeline and some sequence is idle, it sends the next step; several steps in flight keep
every stage busy (a step is on stage 1 while the next is on stage 0).  Each step carries its rows' sampling settings
and the last stage samples them all at once (``models.sampling``), so a step comes back as one token id a row;
only a step with a row whose request needs the logits themselves (log-probabilities, penalties, a bias, a minimum
length: the token history is here) comes back as logits, and its rows are sampled here by the same function, to
the same tokens.  Each token's text is released through its ``TextStream`` and a sequence that ended leaves the
batch before the next step is planned.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import secrets
import time
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import torch

from raycluster_cli.models.sampling import MODE_SKIP, NAN, Params, RowSampling
from raycluster_cli.node.links import DirectLinks, first_stage_ended
from raycluster_cli.serve.anatomy import TIMELINE_STEPS
from raycluster_cli.serve.live import (
    BadInput,
    EngineDown,
    Live,
    Output,
    RequestFailed,
    Resume,
    pick_from_logits,
    step_inputs,
    unsampleable,
)
from raycluster_cli.serve.scheduler import Chunk, Limits, QueueFull, Scheduler
from raycluster_cli.serve.text import Sampling, TextStream, TokenLogprob, out_of_vocab

__all__ = [
    "BadInput", "Engine", "EngineDown", "Output", "QueueFull", "RequestFailed", "Resume", "step_inputs",
]  # fmt: skip

LAG_PERIOD_S = 0.05  # the loop-lag sampler's period: 20 wake-ups a second
LAG_SAMPLES = 200  # the last 10 s of them


class Engine:
    """Continuous batching over ``stages`` (actor handles, in pipeline order)."""

    def __init__(
        self,
        stages: Sequence[Any],
        tokenizer: Any,  # a transformers tokenizer (its class depends on the checkpoint)
        limits: Limits,
        eos_ids: frozenset[int],
        max_in_flight: int | None = None,
        links: DirectLinks | None = None,
        watch: bool = False,
        vocab: int | None = None,
    ) -> None:
        self.stages = list(stages)
        self.vocab = vocab  # the embedding's rows: a request's tokens are checked against it before admission
        self.links = links  # direct links between the stages (node.links); None: Ray's calls relay each step
        if links is not None:
            links.on_down = self.fail  # a ring that broke while idle fails the engine now (the pool replaces it)
        # Ray's calls relay the steps: hold a call open on every stage actor (``links_ended``), so one that dies
        # while no step is pending fails the engine at once too (the links watch their stages themselves)
        self._watch_relay = watch and links is None
        self._watch_task: asyncio.Task[None] | None = None
        self.links_note: str | None = None  # why a pipeline meant to have direct links has none
        self.stage_infos: list[dict[str, Any]] = []  # each stage's device and products' plan, as it loaded
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(limits, eos_ids)
        self.max_in_flight = max_in_flight or len(self.stages)
        self.live: dict[str, Live] = {}
        self.failure: BaseException | None = None
        self.steps_done = 0
        self.last_step_at = 0.0
        self._sent_at = 0.0
        self._steps_sent = itertools.count()  # a step's number: the stages count theirs in the same order
        # (number, sent, arrived, back, handled) wall times of the last steps (serve.anatomy)
        self.recent: deque[tuple[int, float, float, float, float]] = deque(maxlen=TIMELINE_STEPS)
        # how late this loop ran a timer, the last LAG_SAMPLES times (sampled every LAG_PERIOD_S)
        self.loop_lag: deque[float] = deque(maxlen=LAG_SAMPLES)
        self._ids = itertools.count()
        self.shipped: collections.Counter[str] = collections.Counter()  # steps back as "ids" or as "logits"
        self._wake = asyncio.Event()
        # each step sent and not yet back (its number: its tokens), removed by the step itself: no lost wake-up
        self._flight_tokens: dict[int, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # strong references, so running steps are not collected
        self._loop_task: asyncio.Task[None] | None = None
        self._lag_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop_task = loop.create_task(self._loop())
        self._lag_task = loop.create_task(self._watch_lag())
        if self._watch_relay:
            self._watch_task = loop.create_task(self._watch())

    async def _watch(self) -> None:
        self.fail(RuntimeError(f"a stage ended: {await first_stage_ended(self.stages)}"))

    async def _watch_lag(self) -> None:
        """How late the loop wakes a sleeper: a busy loop (many streams, the GIL held by other threads) delays
        every step's hand-back by as much."""
        while True:
            due = time.perf_counter() + LAG_PERIOD_S
            await asyncio.sleep(LAG_PERIOD_S)
            self.loop_lag.append(max(0.0, time.perf_counter() - due))

    @property
    def transport(self) -> str:
        return "direct" if self.links is not None else "ray"

    async def close(self) -> None:
        for task in (self._loop_task, self._lag_task, self._watch_task):
            if task is not None:
                task.cancel()
        if self.links is not None:
            self.links.close()

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def outstanding(self) -> int:
        """Tokens still to prefill or generate here (the router's measure of this pipeline's load)."""
        return self.scheduler.outstanding

    async def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        sampling: Sampling,
        stop: list[str] | None = None,
        probe: bool = False,
        resume: Resume | None = None,
        queue_limit: bool = True,
    ) -> AsyncGenerator[Output, None]:
        """Stream one request's outputs; the last has a ``finish_reason``.  Raises ``QueueFull``,
        ``ValueError`` (too long; ``BadInput``: a token or seed it cannot take), ``EngineDown``, and
        ``RequestFailed`` once admitted (its own row failed); leaving early (client gone) frees its slot.

        ``resume`` continues a request another engine began (failover): its tokens are prefilled
        after the prompt (the KV cache rebuilt), and only what follows them is generated and sent.
        ``queue_limit`` off: a request already admitted elsewhere is never refused here."""
        if self.failure is not None:
            raise EngineDown(f"a stage failed: {self.failure}")
        request_id = f"r{next(self._ids)}"
        done = list(resume.tokens) if resume is not None else []
        live = self._set_up(prompt, done, sampling, stop)
        if resume is not None:
            live.stream.resume(done, resume.released)
        # admitted last: a request refused while being set up holds no slot and no place in the queue
        self.scheduler.add(
            request_id,
            prompt + done,
            max_tokens - len(done),
            queue_limit=queue_limit and not probe,
            ignore_eos=sampling.ignore_eos,
        )
        self.live[request_id] = live
        self._wake.set()
        try:
            while True:
                item = await live.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self.live.pop(request_id, None)
            self.scheduler.finish(request_id, "abort")
            self._wake.set()

    def _set_up(self, prompt: list[int], done: list[int], sampling: Sampling, stop: list[str] | None) -> Live:
        """Everything a request needs before it is admitted; what cannot be set up is a ``BadInput``.  Its tokens
        are the only input of its own a stage reads: checked here, none can fail a step (and so the pipeline)."""
        if self.vocab is not None and (bad := out_of_vocab(prompt + done, self.vocab)) is not None:
            raise BadInput(f"token {bad} is not in the vocabulary (0-{self.vocab - 1})", "prompt")
        # any 64-bit pattern, signed or not (choice i of n draws at seed + i, past 2**63 - 1 too), kept as int64
        if sampling.seed is not None and not -(2**63) <= sampling.seed < 2**64:
            raise BadInput(f"seed {sampling.seed} is outside 64 bits: give one from -2**63 to 2**63 - 1", "seed")
        seed = secrets.randbits(63) if sampling.seed is None else (sampling.seed + 2**63) % 2**64 - 2**63
        stream = TextStream(
            self.tokenizer,
            stop,
            prompt=prompt,
            skip_special=sampling.skip_special_tokens,
            spaces_between_special=sampling.spaces_between_special_tokens,
            include_stop_str=sampling.include_stop_str_in_output,
        )
        return Live(list(prompt), sampling, stream, seed)

    def stalled_s(self) -> float:
        """Seconds steps have been in flight without one coming back (0 when none is in flight): a wedged
        node shows here, since its step neither answers nor fails."""
        if not self._flight_tokens:
            return 0.0
        return time.monotonic() - max(self.last_step_at, self._sent_at)

    def slowest_step_s(self) -> float:
        """The longest round trip of the last steps (0 before any came back): what "overdue" is measured against."""
        return max((back - sent for _, sent, _, back, _ in self.recent), default=0.0)

    async def _loop(self) -> None:
        try:
            await self._plan_steps()
        except Exception as exc:  # a bug in planning must not leave every request waiting forever
            self.fail(exc)
            raise

    async def _plan_steps(self) -> None:
        while True:
            self._wake.clear()
            while self.failure is None and len(self._flight_tokens) < self._steps_wanted():
                rows = -(-self.scheduler.active // self.max_in_flight)  # an even share per step in flight
                chunks = self.scheduler.schedule(max_rows=rows, max_tokens=self._step_budget(rows))
                if not chunks:
                    break
                if not self._flight_tokens:
                    self._sent_at = time.monotonic()
                self._flight_tokens[number := next(self._steps_sent)] = sum(len(c.tokens) for c in chunks)
                task = asyncio.get_running_loop().create_task(self._step(chunks, number))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            self._send_releases()
            await self._wake.wait()

    def _send_releases(self) -> None:
        """The slots of sequences that ended or were preempted: every stage frees their K/V now
        (``BatchedStage.release``: one a newer sequence has begun in since keeps it).  Not awaited: a stage that
        died fails the engine through its steps or its watch."""
        released = self.scheduler.take_released()
        if released and self.failure is None:
            for stage in self.stages:
                stage.release.remote(released)

    def _step_budget(self, rows: int) -> int:
        """Tokens the next step may carry: as many as the heaviest step in flight, and room for its decodes and a
        share of a prompt chunk (``prefill_chunk`` over the steps in flight); ``step_tokens`` when none travels.

        Steps of unequal cost hold each other up in a pipeline: the steps behind a costly one wait at every stage
        and the stages before it idle.  Under a steady load a new prompt's whole chunk in one step of decodes made
        it cost its stages several times the others (measured on the lab: the head stage's mean step 39-41 ms against a
        median of 21-23, 0.55 of the pipeline's ceiling); cut to the steps around it, its chunks travel in
        consecutive steps (they need not wait for each other, ``serve.scheduler``), so the prompt is not
        delayed by round trips.  When every step in flight is heavy (a burst of prompts) the next may be too."""
        share = -(-self.scheduler.limits.prefill_chunk // self.max_in_flight)
        heaviest = max(self._flight_tokens.values(), default=self.scheduler.limits.step_tokens)
        return max(rows + share, heaviest)

    def _steps_wanted(self) -> int:
        """Steps to keep in flight: as many as the active sequences fill at an even share of ``max_in_flight``.

        Four sequences over three stages are two steps of two rows, not three steps of 2, 1 and 1: a step
        of one row costs a stage nearly what a step of two does (its weights are read once per step: on the
        lab a stage of 5 blocks took 10.3 ms of CPU for 1 row, 14.6 ms for 4.2), and a third step only
        queues at the busiest stage.  Capped so, a sequence that comes back alone (or a new one) waits for
        the next step to return and goes with its rows, instead of travelling on in a step of its own for
        the rest of its life (measured: 1.33 rows per step at 4 sequences)."""
        active = self.scheduler.active
        if active == 0:
            return self.max_in_flight
        share = -(-active // self.max_in_flight)
        return -(-active // share)

    async def _step(self, chunks: list[Chunk], number: int) -> None:
        try:
            sent = time.time()
            every = [(live := self.live.get(c.request_id)) is not None and live.wants_every_position(c) for c in chunks]
            params = Params.of([(live.row_sampling(c) if (live := self.live.get(c.request_id))
                                 else RowSampling(mode=MODE_SKIP)) for c in chunks])  # fmt: skip
            ids, table = step_inputs(chunks, every, params)
            out: torch.Tensor
            if self.links is not None:
                out, arrived = await self.links.run(ids, table)
                back = time.time()
            else:
                ref: Any = ids
                for stage in self.stages:
                    ref = stage.forward.remote(ref, table)
                out = await ref
                back = arrived = time.time()
            self.steps_done += 1
            self.last_step_at = time.monotonic()
            self._finish_step(chunks, out, params)
            self.recent.append((number, sent, arrived, back, time.time()))
        except Exception as exc:  # a stage died or failed: every request in flight gets the error
            self.fail(exc)  # (unless the engine failed already: its steps' links closing is not the cause)
        finally:
            del self._flight_tokens[number]
            self._wake.set()

    def _finish_step(self, chunks: list[Chunk], out: torch.Tensor, params: Params) -> None:
        """Hand each row's token to its request: ``out`` is the step's tokens (int64 [B], sampled on the last
        stage) or its logits (sampled here, ``_pick``)."""
        tokens: dict[str, int] = {}
        scored: dict[str, TokenLogprob] = {}
        if out.dtype == torch.int64:
            self.shipped["ids"] += 1
            picked: list[int | Exception] = list(out.tolist())
        else:
            self.shipped["logits"] += 1
            picked = pick_from_logits(chunks, out, params, self.live, self.scheduler.eos_ids, scored)
        for row, chunk in enumerate(chunks):
            live = self.live.get(chunk.request_id)
            if live is None or live.failed:
                if chunk.samples:
                    tokens[chunk.request_id] = 0  # gone while in flight; the scheduler drops it
                continue
            outcome = picked[row]
            if isinstance(outcome, int) and outcome < 0:
                outcome = unsampleable(chunk, "NaN" if outcome == NAN else "+inf")
            if isinstance(outcome, Exception):  # this row's logits or its own settings: only its request fails
                live.failed = True
                tokens[chunk.request_id] = 0
                self.scheduler.finish(chunk.request_id, "error")
                live.queue.put_nowait(outcome if isinstance(outcome, RequestFailed) else RequestFailed(f"{outcome}"))
            elif chunk.samples:
                tokens[chunk.request_id] = outcome
        self._hand_out(chunks, tokens, scored)

    def _hand_out(self, chunks: list[Chunk], tokens: dict[str, int], scored: dict[str, TokenLogprob]) -> None:
        for event in self.scheduler.complete(chunks, tokens):
            live = self.live.get(event.request_id)
            if live is None or event.token is None:
                continue
            reason = event.finish_reason
            eos = reason == "stop"  # the scheduler ends a sequence with "stop" at its EOS only
            live.stream.push(event.token, text=not eos or live.sampling.include_stop_str_in_output)
            text, stopped = live.stream.take(final=reason is not None)
            if stopped and reason != "stop":  # a stop string in the last allowed token's text is still a stop
                if reason is None:
                    self.scheduler.finish(event.request_id, "stop")
                reason = "stop"
            logprob = (scored[event.request_id],) if event.request_id in scored else ()
            prompt_scored = () if live.answered else tuple(live.prompt_scored)
            live.answered = True
            out = Output(text, tuple(live.stream.ids), reason, live.prompt_tokens, logprob, prompt_scored)
            live.queue.put_nowait(out)

    def fail(self, exc: BaseException) -> None:
        """Stop taking work and hand every request here ``EngineDown`` (a stage died or is wedged).  The first
        cause is kept: the steps that then fail as their links close do not replace it."""
        if self.failure is not None:
            return
        self.failure = exc
        if self.links is not None:  # nothing more goes out on them (the stages are killed next)
            self.links.close()
        down = EngineDown(f"a stage failed: {type(exc).__name__}: {exc}")
        for live in self.live.values():
            live.queue.put_nowait(down)

    async def probe(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """A real greedy generation of two tokens through every stage: what readiness means here."""
        began = time.perf_counter()

        async def run() -> list[int]:
            tokens: list[int] = []
            async for out in self.generate([0], 2, Sampling(temperature=0), probe=True):
                tokens = list(out.token_ids)
            return tokens

        tokens = await asyncio.wait_for(run(), timeout_s)
        if len(tokens) < 1:
            raise EngineDown("the probe generation produced no token")
        return {"tokens": tokens, "seconds": time.perf_counter() - began, "stages": len(self.stages)}
