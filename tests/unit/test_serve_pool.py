"""The pool without Ray: the router's choice and failover's exact continuation.

Pipelines are in-process ``BatchedStage``s behind the handle shape the engine calls
(``forward.remote`` returning an awaitable); one stage can be made to die after some steps, as a
killed actor's call fails.  The reference for every greedy answer is ``transformers``' ``generate``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from raycluster_cli.models.batched import BatchedStage  # noqa: E402
from raycluster_cli.models.decoder import config_from_checkpoint  # noqa: E402
from raycluster_cli.placement.pipelines import PipelinePlan  # noqa: E402
from raycluster_cli.serve import pool as pool_module  # noqa: E402
from raycluster_cli.serve.engine import Engine  # noqa: E402
from raycluster_cli.serve.metrics import MemoryRecorder, StageMeter, image_request  # noqa: E402
from raycluster_cli.serve.pool import Pipeline, Pool, least_loaded, pipeline_load  # noqa: E402
from raycluster_cli.serve.scheduler import Limits, Scheduler  # noqa: E402
from raycluster_cli.serve.text import Sampling, TextStream, eos_ids  # noqa: E402

from ..serve_checkpoint import WORDS, write_chat_llama  # noqa: E402
from ..text_tokenizers import in_context  # noqa: E402

NEW_TOKENS = 14
PROMPTS = [" ".join(WORDS[(5 * i + j) % len(WORDS)] for j in range(n)) for i, n in enumerate((2, 7, 4, 11, 3, 9))]


class _Died(RuntimeError):
    """What a call on a killed actor raises (RayActorError in the service)."""


class _Call:
    def __init__(self, stage: _Stage, args: tuple[Any, ...], delay_s: float = 0.0) -> None:
        self.stage, self.args, self.delay_s = stage, args, delay_s

    def __await__(self) -> Any:
        yield from asyncio.sleep(self.delay_s).__await__()
        args = []
        for arg in self.args:  # a previous stage's call, as an ObjectRef passed on
            args.append((yield from arg.__await__()) if isinstance(arg, _Call) else arg)
        out = self.stage.forward_now(*args)
        if self.stage.frozen():  # a frozen host: the call neither answers nor fails, ever
            yield from asyncio.get_running_loop().create_future().__await__()
        if self.stage.slow_s:  # a slow step on a host that is alive
            yield from asyncio.sleep(self.stage.slow_s).__await__()
        return out


class _Stage:
    """A stage handle over an in-process BatchedStage; ``die_after`` forward calls it fails (as dead), from
    ``freeze_after`` calls on it hangs (as on a frozen host, where no connection closes)."""

    def __init__(self, stage: BatchedStage, step_s: float = 0.0) -> None:
        self.stage, self.calls, self.die_after, self.freeze_after, self.slow_s = stage, 0, -1, -1, 0.0
        self.forward = SimpleNamespace(remote=lambda *a: _Call(self, a, step_s))
        self.release = SimpleNamespace(remote=stage.release)

    def frozen(self) -> bool:
        return 0 <= self.freeze_after < self.calls

    def forward_now(self, x: Any, table: Any) -> Any:
        self.calls += 1
        if 0 <= self.die_after < self.calls:
            raise _Died("the actor died")
        return self.stage.forward(x, table)


class _Backend:
    """Builds pipelines in process; pipeline ``doomed``'s last stage dies after ``die_after`` steps."""

    def __init__(
        self,
        path: Path,
        doomed: int = -1,
        die_after: int = -1,
        rebuild_s: float = 0.0,
        step_s: float = 0.0,
        freeze_after: int = -1,
    ) -> None:
        self.cfg = config_from_checkpoint(path, max_seq=96)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        self.eos = eos_ids(self.tokenizer, json.loads((path / "generation_config.json").read_text()))
        self.limits = Limits(slots=4, max_seq=96, prefill_chunk=4, step_tokens=24)
        self.doomed, self.die_after, self.rebuild_s, self.step_s = doomed, die_after, rebuild_s, step_s
        self.freeze_after = freeze_after  # pipeline ``doomed``'s last stage hangs from this many steps on
        self.asked: list[int] = []  # the pipelines whose stages were pinged
        self.asking = self.most_asking = 0  # asks under way now, and the most at once
        self.built: list[int] = []
        self.resplit_to: PipelinePlan | None = None

    async def build(self, plan: PipelinePlan, index: int) -> tuple[Engine, list[Any]]:
        if self.built:
            await asyncio.sleep(self.rebuild_s)  # a replacement loads its stages
        stages = [_Stage(BatchedStage(self.cfg, a, b, self.limits.slots), self.step_s) for a, b in plan.ranges]
        engine = Engine(stages, self.tokenizer, self.limits, self.eos)
        engine.start()
        await engine.probe()
        if index == self.doomed and self.die_after >= 0:
            stages[-1].die_after = stages[-1].calls + self.die_after
        if index == self.doomed and self.freeze_after >= 0:
            stages[-1].freeze_after = stages[-1].calls + self.freeze_after
        self.built.append(index)
        return engine, stages

    async def stop(self, pipeline: Pipeline) -> None:
        pass

    async def replacement(self, dead: Pipeline, others: Sequence[Pipeline]) -> PipelinePlan | None:
        return dead.plan

    async def growth(self, pipelines: Sequence[Pipeline]) -> list[tuple[Pipeline | None, PipelinePlan]]:
        return []

    async def unanswered(self, pipeline: Pipeline, timeout_s: float) -> str | None:
        """A frozen stage answers no ping: the caller waits the whole ``timeout_s`` for nothing."""
        self.asked.append(pipeline.index)
        self.asking += 1
        self.most_asking = max(self.most_asking, self.asking)
        try:
            frozen = [i for i, stage in enumerate(pipeline.stages) if stage.frozen()]
            if frozen:
                await asyncio.sleep(timeout_s)
                return f"stage {frozen[0]} did not answer within {timeout_s} s"
            return None
        finally:
            self.asking -= 1

    async def rebalance(self, pipeline: Pipeline) -> PipelinePlan | None:
        """``resplit_to`` once, for a pipeline whose engine has requests running (a loaded window)."""
        if self.resplit_to is None or not pipeline.engine.live:
            return None
        plan, self.resplit_to = self.resplit_to, None
        return plan


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_llama(tmp_path_factory.mktemp("pool") / "ckpt")


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> dict[str, tuple[str, list[int]]]:
    """transformers' own greedy text and tokens for every prompt."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint)).eval()
    answers = {}
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS)
        new = out[0, len(ids) :]
        answers[prompt] = (in_context(tokenizer, ids, new.tolist()), new.tolist())
    return answers


def _fake(index: int, outstanding: int, requests: int) -> Any:
    return SimpleNamespace(index=index, engine=SimpleNamespace(outstanding=outstanding, live=[0] * requests))


def test_the_router_picks_the_least_outstanding_tokens_not_the_next_in_turn() -> None:
    busy, idle, fewer = _fake(0, 40, 1), _fake(1, 12, 3), _fake(2, 12, 2)
    assert least_loaded([busy, idle, fewer], pipeline_load) is fewer  # equal tokens: fewer requests win
    assert least_loaded([busy, _fake(1, 41, 0)], pipeline_load) is busy
    assert least_loaded([], pipeline_load) is None


def test_outstanding_counts_prompt_left_to_prefill_and_tokens_left_to_generate() -> None:
    s = Scheduler(Limits(slots=1, prefill_chunk=4, step_tokens=4))
    s.add("a", list(range(10)), 5)
    s.add("b", [1, 2], 3)  # waits for the slot
    assert s.outstanding == 10 + 5 + 2 + 3
    chunks = s.schedule()
    s.complete(chunks, {})
    assert s.outstanding == 6 + 5 + 5  # 4 of a's prompt are in its cache


def test_a_resumed_text_stream_sends_exactly_what_the_first_one_held_back(checkpoint: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    ids = tokenizer.encode("the cat run to the river and the dog sing")
    stop = ["and the dog"]
    whole, want = TextStream(tokenizer, stop), ""
    for token in ids:
        whole.push(token)
        want += whole.take()[0]
    want += whole.take(final=True)[0]
    assert want == "the cat run to the river "  # the stop string and what follows are held back
    for cut in range(1, len(ids)):
        first, sent = TextStream(tokenizer, stop), ""
        for token in ids[:cut]:
            first.push(token)
            sent += first.take()[0]
        again = TextStream(tokenizer, stop)
        again.resume(ids[:cut], len(sent))
        for token in ids[cut:]:
            again.push(token)
            sent += again.take()[0]
        assert sent + again.take(final=True)[0] == want, cut


async def _stream(pool: Pool, prompt: str, tokenizer: Any, stream: bool) -> tuple[str, list[int]]:
    text, tokens = "", []
    async for out in pool.generate(tokenizer.encode(prompt), NEW_TOKENS, Sampling(temperature=0), stream=stream):
        text, tokens = text + out.text, list(out.token_ids)
    return text, tokens


def test_requests_of_a_pipeline_that_dies_finish_on_the_other_token_for_token(
    checkpoint: Path, reference: dict[str, tuple[str, list[int]]]
) -> None:
    """Pipeline 0 dies 9 steps in; its streams continue on pipeline 1 after the tokens they had, its
    whole answers run again there; every text is generate()'s; the dead pipeline is rebuilt."""
    backend = _Backend(checkpoint, doomed=0, die_after=9)

    async def run() -> tuple[list[tuple[str, list[int]]], Pool]:
        pool = Pool(backend, watch_s=0.05, replace_period_s=3600)
        plan = PipelinePlan(("", ""), ("", ""), ((0, 3), (3, backend.cfg.num_units)))
        for _ in range(2):
            await pool.add(plan)
        pool.start()
        calls = [_stream(pool, p, backend.tokenizer, stream=i % 3 != 2) for i, p in enumerate(PROMPTS)]
        answers = list(await asyncio.gather(*calls))
        for _ in range(100):
            if len(pool.live()) == 2:
                break
            await asyncio.sleep(0.05)
        await pool.close()
        return answers, pool

    answers, pool = asyncio.run(run())
    assert pool.failovers >= 2  # both kinds moved: streamed and whole
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        assert answer == reference[prompt], prompt  # the same text and tokens: none repeated, none lost
    assert [p.index for p in pool.live()] == [1, 2] and backend.built == [0, 1, 2]
    assert [e["event"] for e in pool.events if e["event"] in ("failed", "replaced")] == ["failed", "replaced"]


def test_requests_that_find_the_only_pipeline_being_rebuilt_wait_for_it_instead_of_failing(
    checkpoint: Path, reference: dict[str, tuple[str, list[int]]]
) -> None:
    """One replica (every node in one pipeline) loses a stage; requests that arrive while its replacement is being
    built (0.5 s here) are answered by the replacement, not refused with 503."""
    backend = _Backend(checkpoint, doomed=0, die_after=3, rebuild_s=0.5)

    async def run() -> tuple[list[tuple[str, list[int]]], list[tuple[str, list[int]]], int]:
        pool = Pool(backend, watch_s=0.05, replace_period_s=3600)
        await pool.add(PipelinePlan(("", ""), ("", ""), ((0, 3), (3, backend.cfg.num_units))))
        pool.start()
        first = asyncio.gather(*(_stream(pool, p, backend.tokenizer, stream=True) for p in PROMPTS[:2]))
        for _ in range(200):
            if not pool.live() and pool.rebuilding:
                break
            await asyncio.sleep(0.01)
        down = len(pool.live())
        later = await asyncio.gather(
            *(_stream(pool, p, backend.tokenizer, stream=i % 2 == 0) for i, p in enumerate(PROMPTS[2:]))
        )
        answers = await first
        await pool.close()
        return list(answers), list(later), down

    answers, later, down = asyncio.run(run())
    assert down == 0  # the later requests really came while no pipeline was live
    for prompt, answer in zip(PROMPTS, answers + later, strict=True):
        assert answer == reference[prompt], prompt
    assert backend.built == [0, 1]


def test_a_request_in_the_moment_between_a_failure_and_the_watch_s_look_waits_for_the_replacement(
    checkpoint: Path, reference: dict[str, tuple[str, list[int]]]
) -> None:
    """The only pipeline's engine fails (a stage's links ended) and a request arrives before the pool's watch has
    looked (it looks every ``watch_s``): the replacement is on its way, so the request waits for it and gets its
    answer, not a 503 "no pipeline is serving" (seen on the lab: 6 of 802 requests in that half second)."""
    backend = _Backend(checkpoint, rebuild_s=0.2)

    async def run() -> tuple[tuple[str, list[int]], int]:
        pool = Pool(backend, watch_s=1.0, replace_period_s=3600)
        await pool.add(PipelinePlan(("", ""), ("", ""), ((0, 3), (3, backend.cfg.num_units))))
        pool.start()
        await asyncio.sleep(0.05)
        pool.pipelines[0].engine.fail(RuntimeError("a stage's links ended"))
        rebuilding = pool.rebuilding  # the watch has not looked yet
        answer = await _stream(pool, PROMPTS[0], backend.tokenizer, stream=True)
        await pool.close()
        return answer, rebuilding

    answer, rebuilding = asyncio.run(run())
    assert rebuilding == 0
    assert answer == reference[PROMPTS[0]]
    assert backend.built == [0, 1]


def test_a_pipeline_re_split_under_load_swaps_without_failing_or_changing_an_answer(
    checkpoint: Path, reference: dict[str, tuple[str, list[int]]]
) -> None:
    """The backend finds a better split while requests run: the new pipeline is built beside the old one, new
    requests go to it, the old one finishes its own and is retired; every answer is generate()'s, none failed."""
    backend = _Backend(checkpoint, rebuild_s=0.2, step_s=0.01)  # requests long enough to be running at the look
    units = backend.cfg.num_units
    backend.resplit_to = PipelinePlan(("", ""), ("", ""), ((0, 2), (2, units)), why="re-split")

    async def run() -> tuple[list[tuple[str, list[int]]], list[tuple[str, list[int]]], Pool]:
        pool = Pool(backend, watch_s=0.05, replace_period_s=3600, rebalance_period_s=0.1)
        await pool.add(PipelinePlan(("", ""), ("", ""), ((0, 4), (4, units))))
        pool.start()
        first = asyncio.gather(*(_stream(pool, p, backend.tokenizer, stream=i % 2 == 0) for i, p in enumerate(PROMPTS)))
        for _ in range(400):
            if len(backend.built) == 2:
                break
            await asyncio.sleep(0.01)
        later = await asyncio.gather(*(_stream(pool, p, backend.tokenizer, stream=True) for p in PROMPTS[:3]))
        answers = await first
        for _ in range(100):
            if len(pool.pipelines) == 1:
                break
            await asyncio.sleep(0.05)
        await pool.close()
        return list(answers), list(later), pool

    answers, later, pool = asyncio.run(run())
    for prompt, answer in zip(PROMPTS + PROMPTS[:3], answers + later, strict=True):
        assert answer == reference[prompt], prompt
    assert pool.failovers == 0 and backend.built == [0, 1]
    (only,) = pool.pipelines
    assert only.index == 1 and only.plan.ranges == ((0, 2), (2, units)) and only.served >= 3
    assert [e["event"] for e in pool.events] == ["rebalanced", "retired"]


def test_a_frozen_stage_fails_its_pipeline_within_seconds_and_its_requests_finish_on_the_other(
    checkpoint: Path, reference: dict[str, tuple[str, list[int]]]
) -> None:
    """Pipeline 0's last stage hangs 9 steps in (its host frozen: no call fails, no connection closes).  Its steps
    are overdue, its stages are pinged, the frozen one does not answer: the pipeline is failed then, not at the
    30 s stall deadline, and every request on it finishes on pipeline 1 with generate()'s text."""
    backend = _Backend(checkpoint, doomed=0, freeze_after=9)

    async def run() -> tuple[list[tuple[str, list[int]]], Pool, float]:
        pool = Pool(backend, watch_s=0.05, replace_period_s=3600, suspect_floor_s=0.3, answer_timeout_s=1.0)
        plan = PipelinePlan(("", ""), ("", ""), ((0, 3), (3, backend.cfg.num_units)))
        for _ in range(2):
            await pool.add(plan)
        pool.start()
        began = asyncio.get_running_loop().time()
        calls = [_stream(pool, p, backend.tokenizer, stream=i % 3 != 2) for i, p in enumerate(PROMPTS)]
        answers = list(await asyncio.gather(*calls))
        took = asyncio.get_running_loop().time() - began
        await pool.close()
        return answers, pool, took

    answers, pool, took = asyncio.run(run())
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        assert answer == reference[prompt], prompt
    assert pool.failovers >= 1 and 0 in backend.asked
    failed = [e for e in pool.events if e["event"] == "failed"]
    assert [e["pipeline"] for e in failed] == [0] and "stage 1 did not answer" in failed[0]["detail"]
    assert took < 10.0  # the stall deadline alone (30 s) would have held the frozen pipeline's requests 30 s
    assert backend.most_asking == 1  # an ask longer than the suspicion is not joined by a second one


def test_a_slow_step_on_stages_that_answer_is_waited_for_not_failed(
    checkpoint: Path, reference: dict[str, tuple[str, list[int]]]
) -> None:
    """Steps overdue on stages that answer their pings (a long chunk, a loaded host) are waited for: the look asks,
    nothing is failed or moved, every answer is generate()'s."""
    backend = _Backend(checkpoint)

    async def run() -> tuple[list[tuple[str, list[int]]], Pool]:
        pool = Pool(backend, watch_s=0.05, replace_period_s=3600, suspect_floor_s=0.2, answer_timeout_s=0.2)
        pipeline = await pool.add(PipelinePlan(("", ""), ("", ""), ((0, 3), (3, backend.cfg.num_units))))
        pipeline.stages[-1].slow_s = 0.6  # every step three times the floor, far over 10 x a fast step
        pool.start()
        answers = await asyncio.gather(*(_stream(pool, p, backend.tokenizer, stream=True) for p in PROMPTS[:2]))
        await pool.close()
        return list(answers), pool

    answers, pool = asyncio.run(run())
    for prompt, answer in zip(PROMPTS[:2], answers, strict=True):
        assert answer == reference[prompt], prompt
    assert backend.asked and pool.failovers == 0 and pool.events == []


def test_the_service_metrics_count_every_request_its_tokens_times_and_failovers(
    checkpoint: Path, reference: dict[str, tuple[str, list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a failover: each request ended is counted once with its finish reason, its prompt and generated
    tokens, its time to first token, per output token and end to end; the failovers; a client that leaves counts as
    an abort, a prompt too long as refused; the pipelines' gauges, and a removed pipeline's set to 0."""
    backend = _Backend(checkpoint, doomed=0, die_after=9)
    recorder = MemoryRecorder()
    monkeypatch.setattr(pool_module, "GAUGES_S", 3600.0)  # the gauges set only where the test says

    async def run() -> Pool:
        pool = Pool(backend, watch_s=0.05, replace_period_s=3600, recorder=recorder, model="m")
        plan = PipelinePlan(("", ""), ("", ""), ((0, 3), (3, backend.cfg.num_units)))
        for _ in range(2):
            await pool.add(plan)
        pool.start()
        calls = [_stream(pool, p, backend.tokenizer, stream=i % 3 != 2) for i, p in enumerate(PROMPTS)]
        running = asyncio.gather(*calls)
        while not pool.pipelines[0].engine.scheduler.running:
            await asyncio.sleep(0.001)
        pool.gauges()  # pipeline 0 busy: its KV slots in use
        await running
        pool.gauges()  # the failed pipeline 0 was replaced by pipeline 2: its gauges go to 0
        gone = pool.generate(backend.tokenizer.encode(PROMPTS[0]), NEW_TOKENS, Sampling(temperature=0), stream=True)
        await anext(gone)
        await gone.aclose()  # the client left after its first piece
        with pytest.raises(ValueError):
            await anext(pool.generate([1] * 200, NEW_TOKENS, Sampling(temperature=0), stream=True))
        for _ in range(100):  # the replacement live, the aborted request's slot freed once its step is back
            if len(pool.live()) == 2 and not any(p.engine.scheduler.running for p in pool.pipelines):
                break
            await asyncio.sleep(0.05)
        pool.gauges()
        await pool.close()
        return pool

    pool = asyncio.run(run())
    done = len(PROMPTS)
    assert recorder.total("raycluster_serve_requests", finish_reason="length") == done
    assert recorder.total("raycluster_serve_requests", finish_reason="abort") == 1
    assert recorder.total("raycluster_serve_requests", finish_reason="refused") == 1
    assert recorder.total("raycluster_serve_requests", finish_reason="error") == 0
    prompts = sum(len(backend.tokenizer.encode(p)) for p in PROMPTS)
    assert recorder.total("raycluster_serve_prompt_tokens") == prompts + len(backend.tokenizer.encode(PROMPTS[0])) + 200
    generated = sum(len(reference[p][1]) for p in PROMPTS)
    assert generated - 1 <= recorder.total("raycluster_serve_generation_tokens") - 1 <= generated + NEW_TOKENS
    ttft = recorder.observed("raycluster_serve_time_to_first_token_seconds")
    assert len(ttft) == done + 1 and all(t > 0 for t in ttft)
    e2e = recorder.observed("raycluster_serve_e2e_request_latency_seconds")
    tpot = recorder.observed("raycluster_serve_time_per_output_token_seconds")
    assert len(tpot) == done and all(0 < t < e for t, e in zip(tpot, e2e, strict=False))
    assert recorder.total("raycluster_serve_failovers", model="m") == pool.failovers >= 1
    assert recorder.last("raycluster_serve_replicas_live", model="m") == 2
    assert recorder.last("raycluster_serve_requests_running", pipeline="1") == 0
    busy, *_, gone = recorder.observed("raycluster_serve_kv_slots_used_ratio", pipeline="0")
    assert busy > 0 and gone == 0  # then removed: set to 0 (a gauge keeps its last value)
    assert recorder.observed("raycluster_serve_kv_slots_used_ratio", pipeline="2")


def test_a_request_of_n_choices_counts_once_with_its_prompt_and_every_choice_s_tokens(checkpoint: Path) -> None:
    """The n generations of one request (``choice`` 0..n-1): the request and its prompt tokens are counted with the
    first choice only, as the answer's usage counts them; each choice's tokens and times are its own."""
    backend = _Backend(checkpoint)
    recorder = MemoryRecorder()
    prompt = backend.tokenizer.encode(PROMPTS[0])

    async def run() -> int:
        pool = Pool(backend, watch_s=0.05, replace_period_s=3600, recorder=recorder, model="m")
        await pool.add(PipelinePlan(("", ""), ("", ""), ((0, 3), (3, backend.cfg.num_units))))
        pool.start()

        async def choice(i: int) -> int:
            tokens = 0
            async for out in pool.generate(
                prompt, NEW_TOKENS, Sampling(temperature=1.0, seed=i), stream=True, choice=i
            ):
                tokens = len(out.token_ids)
            return tokens

        made = await asyncio.gather(*(choice(i) for i in range(3)))
        await pool.close()
        return sum(made)

    generated = asyncio.run(run())
    assert recorder.total("raycluster_serve_requests") == 1
    assert recorder.total("raycluster_serve_prompt_tokens") == len(prompt)
    assert recorder.total("raycluster_serve_generation_tokens") == generated >= 3
    assert len(recorder.observed("raycluster_serve_time_to_first_token_seconds")) == 3


def test_a_stage_meter_adds_its_steps_and_busy_seconds_on_its_own_thread() -> None:
    recorder = MemoryRecorder()
    totals = [0, 0.0]  # the stage's own running counts
    tags = {"model": "m", "pipeline": "0", "stage": "1", "node_ip": "10.0.0.2"}
    StageMeter(recorder, tags, lambda: (int(totals[0]), float(totals[1])), flush_s=0.05).start()
    for _ in range(5):
        totals[0] += 1
        totals[1] += 0.01
    for _ in range(100):
        if recorder.total("raycluster_serve_stage_steps") == 5:
            break
        time.sleep(0.02)
    assert recorder.total("raycluster_serve_stage_steps", node_ip="10.0.0.2") == 5
    assert abs(recorder.total("raycluster_serve_stage_busy_seconds", stage="1") - 0.05) < 1e-9


def test_an_image_request_counts_its_outcome_and_only_a_made_one_its_images_and_seconds() -> None:
    recorder = MemoryRecorder()
    image_request(recorder, "sd", "ok", 4, 2.5)
    image_request(recorder, "sd", "refused", 2, 0.01)
    assert recorder.total("raycluster_serve_image_requests", outcome="ok") == 1
    assert recorder.total("raycluster_serve_image_requests", outcome="refused") == 1
    assert recorder.total("raycluster_serve_images") == 4
    assert recorder.observed("raycluster_serve_image_request_seconds") == [2.5]
