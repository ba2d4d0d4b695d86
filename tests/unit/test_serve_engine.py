"""The engine's loop without Ray: stage handles are replaced by in-process calls of the same BatchedStage.

What is checked here is the engine's own bookkeeping: a sequence that ends (stop string, client gone)
gives its slot back before the next step, and a request that arrives while others run joins them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from raycluster_cli.models.batched import BatchedStage  # noqa: E402
from raycluster_cli.models.decoder import config_from_checkpoint  # noqa: E402
from raycluster_cli.serve.engine import Engine, step_inputs  # noqa: E402
from raycluster_cli.serve.scheduler import Chunk, Limits  # noqa: E402
from raycluster_cli.serve.text import Sampling  # noqa: E402

from ..serve_checkpoint import write_chat_llama  # noqa: E402


class _Done:
    """An already computed result that can be awaited, as an ObjectRef can."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self) -> Any:
        yield from asyncio.sleep(0).__await__()
        return self.value


class _Method:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> _Done:
        return _Done(self.fn(*(a.value if isinstance(a, _Done) else a for a in args)))


class _InProcessStage:
    """Has what the engine uses of a stage actor handle: ``forward.remote``, ``release.remote``."""

    def __init__(self, stage: BatchedStage) -> None:
        self.stage = stage
        self.forward = _Method(stage.forward)
        self.release = _Method(stage.release)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_llama(tmp_path_factory.mktemp("engine") / "ckpt")


def _engine(path: Path, slots: int = 2) -> Engine:
    cfg = config_from_checkpoint(path, max_seq=64)
    half = 1 + cfg.layers // 2
    stages = [_InProcessStage(BatchedStage(cfg, a, b, slots)) for a, b in ((0, half), (half, cfg.num_units))]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    return Engine(stages, tokenizer, Limits(slots=slots, max_seq=64, prefill_chunk=4), frozenset())


def test_step_inputs_pad_rows_and_list_slot_start_length() -> None:
    ids, table = step_inputs([Chunk("a", 1, 5, (9,), True), Chunk("b", 0, 0, (3, 4, 5), False)])
    assert ids.tolist() == [[9, 0, 0], [3, 4, 5]]
    assert table.tolist() == [[1, 0], [5, 0], [1, 3]]


def test_stop_and_a_client_leaving_free_their_slots_at_once(checkpoint: Path) -> None:
    async def run() -> None:
        engine = _engine(checkpoint)
        engine.start()
        greedy = Sampling(temperature=0)
        full = [out async for out in engine.generate([7, 8, 9], 10, greedy)]
        text = "".join(o.text for o in full)
        stop = " " + text.split(" ")[2]
        outs = []
        async for out in engine.generate([7, 8, 9], 10, greedy, stop=[stop]):
            outs.append(out)
            if out.finish_reason:
                assert not engine.scheduler.running  # left the batch before any further step
        assert outs[-1].finish_reason == "stop" and "".join(o.text for o in outs) == text[: text.index(stop)]
        leaving = engine.generate([7, 8, 9], 10, greedy)
        await anext(leaving)
        await leaving.aclose()  # the client went away after its first token
        assert not engine.scheduler.running and len(engine.scheduler.free_slots) == 2
        await engine.close()

    asyncio.run(run())


def test_a_request_arriving_mid_generation_runs_beside_the_first(checkpoint: Path) -> None:
    async def run() -> tuple[list[int], list[int]]:
        engine = _engine(checkpoint)
        engine.start()
        first = engine.generate([5, 6, 7, 8, 9, 10, 11], 12, Sampling(temperature=0))
        await anext(first)
        later = asyncio.ensure_future(_tokens(engine.generate([12, 13], 3, Sampling(temperature=0))))
        rest = [o async for o in first]
        later_tokens = await later
        await engine.close()
        return list(rest[-1].token_ids), later_tokens

    first_tokens, later_tokens = asyncio.run(run())
    assert len(first_tokens) == 12 and len(later_tokens) == 3
    alone = asyncio.run(_alone(checkpoint, [12, 13], 3))
    assert later_tokens == alone  # joining a running batch does not change a greedy answer


async def _tokens(outputs: Any) -> list[int]:
    tokens: list[int] = []
    async for out in outputs:
        tokens = list(out.token_ids)
    return tokens


async def _alone(path: Path, prompt: list[int], n: int) -> list[int]:
    engine = _engine(path)
    engine.start()
    tokens = await _tokens(engine.generate(prompt, n, Sampling(temperature=0)))
    await engine.close()
    return tokens


class _TimedStage:
    """A stage actor's handle that takes ``seconds`` per step, as a remote call does (awaited, not blocking),
    and records each step's rows; the last one answers logits that always pick token 5."""

    def __init__(self, seconds: float, rows: list[int] | None = None, vocab: int = 0) -> None:
        self.seconds, self.rows, self.vocab = seconds, rows, vocab
        self.forward = self
        self.release = _Method(lambda ended: None)  # it holds no K/V

    def remote(self, x: Any, table: Any) -> Any:
        async def run() -> Any:
            value = await x if asyncio.isfuture(x) else x
            await asyncio.sleep(self.seconds)
            if self.rows is not None:
                self.rows.append(int(table.shape[1]))
            if self.vocab:
                logits = torch.zeros(table.shape[1], self.vocab)
                logits[:, 5] = 1.0
                return logits
            return value

        return asyncio.ensure_future(run())


def test_four_sequences_over_three_stages_go_two_to_a_step(checkpoint: Path) -> None:
    """Session 22 on the lab: 4 sequences on a 3-stage pipeline travelled as 1.33 rows per step, a sequence
    that arrived alone keeping a step of its own; a step of one row costs a stage nearly what two do."""
    rows: list[int] = []
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    vocab = len(tokenizer)
    stages = [_TimedStage(0.004), _TimedStage(0.004), _TimedStage(0.004, rows, vocab)]

    async def run() -> list[list[int]]:
        engine = Engine(stages, tokenizer, Limits(slots=4, max_seq=64), frozenset())
        engine.start()
        sampling = Sampling(temperature=0, ignore_eos=True)
        first = asyncio.ensure_future(_tokens(engine.generate([7, 8], 20, sampling)))
        await asyncio.sleep(0.002)  # the first is on its way alone when the others come
        others = [asyncio.ensure_future(_tokens(engine.generate([9, 10], 20, sampling))) for _ in range(3)]
        done = await asyncio.gather(first, *others)
        await engine.close()
        return done

    done = asyncio.run(run())
    assert all(len(tokens) == 20 for tokens in done)
    steady = rows[4:-4]  # after the arrivals settled, before the first finish
    assert steady and sum(steady) / len(steady) >= 1.9, rows


@pytest.mark.parametrize(("per_step", "want"), [(False, 2), (True, 4)])
def test_a_full_pipeline_carries_slots_rows_in_every_step_in_flight(
    checkpoint: Path, per_step: bool, want: int
) -> None:
    """Session 23 on the lab: 32 requests on 3 stages with 16 slots went 4.3 rows per step (16 shared by three
    steps in flight) against 12 on one node.  With the pipeline's limits (``for_steps``) each step in flight
    has its own 4 slots: 12 sequences run at once and a step carries 4 rows, not 2."""
    rows: list[int] = []
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    stages = [_TimedStage(0.004), _TimedStage(0.004), _TimedStage(0.004, rows, len(tokenizer))]
    limits = Limits(slots=4, max_seq=64)

    async def run() -> list[list[int]]:
        engine = Engine(stages, tokenizer, limits.for_steps(3) if per_step else limits, frozenset())
        engine.start()
        sampling = Sampling(temperature=0, ignore_eos=True)
        done = await asyncio.gather(*(_tokens(engine.generate([9, 10], 12, sampling)) for _ in range(12)))
        await engine.close()
        return done

    done = asyncio.run(run())
    assert all(len(tokens) == 12 for tokens in done)
    assert max(rows) == want and sorted(rows)[len(rows) // 2] == want, rows  # the median step is full


def test_a_prompt_arriving_among_decodes_is_cut_to_the_steps_around_it(checkpoint: Path) -> None:
    """Under a steady load a new prompt's whole chunk went into one step among steps of a few decodes, which then
    cost each stage several times the others: the steps behind it queued and the stages before it idled (session
    28: 0.55 of the pipeline's ceiling held at 32 requests).  Now a step carries no more than the heaviest step in
    flight, or its decodes and a third of a chunk (three steps in flight), and the prompt's pieces follow each
    other in consecutive steps."""
    tokens: list[int] = []
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))

    class _Counting(_TimedStage):
        def remote(self, x: Any, table: Any) -> Any:
            tokens.append(int(table[2].sum()))
            return super().remote(x, table)

    stages = [_Counting(0.004), _TimedStage(0.004), _TimedStage(0.004, None, len(tokenizer))]
    limits = Limits(slots=4, max_seq=64, step_tokens=64, prefill_chunk=16).for_steps(3)

    async def run() -> tuple[list[list[int]], int]:
        engine = Engine(stages, tokenizer, limits, frozenset())
        engine.start()
        sampling = Sampling(temperature=0, ignore_eos=True)
        running = [asyncio.ensure_future(_tokens(engine.generate([9, 10], 24, sampling))) for _ in range(3)]
        await asyncio.sleep(0.06)  # they decode, three steps in flight, when three long prompts come at once
        before = len(tokens)
        late = [asyncio.ensure_future(_tokens(engine.generate(list(range(3, 19)), 4, sampling))) for _ in range(3)]
        done = await asyncio.gather(*running, *late)
        await engine.close()
        return done, before

    done, before = asyncio.run(run())
    assert [len(t) for t in done] == [24, 24, 24, 4, 4, 4]
    late = tokens[before:]
    # rows of 2 (6 sequences over 3 steps) and a third of 16: at most 8 tokens, where a step took a whole chunk of
    # 16 beside its decodes before
    assert max(late) <= 8, late
    assert sum(late) >= 3 * 16, late  # every prompt token went, spread over the steps


def test_logprobs_are_the_models_own_for_each_generated_token(checkpoint: Path) -> None:
    """A request that asks for log-probabilities gets, with each token, its log-softmax under the checkpoint's
    own logits (``transformers``' forward over prompt + tokens), and the k best there, while a request beside it
    that did not ask gets none; sampled at a temperature, the logprobs are still the model's, not the tempered."""
    prompt = [5, 6, 7, 8, 9]

    async def run() -> tuple[list[Any], list[Any]]:
        engine = _engine(checkpoint)
        engine.start()
        asked = asyncio.ensure_future(
            _outputs(engine.generate(prompt, 6, Sampling(temperature=0.7, seed=3, logprobs=3)))
        )
        plain = await _outputs(engine.generate([12, 13], 4, Sampling(temperature=0)))
        outs = await asked
        await engine.close()
        return outs, plain

    outs, plain = asyncio.run(run())
    assert all(o.logprobs == () for o in plain)
    assert [len(o.logprobs) for o in outs] == [1] * len(outs)
    tokens = list(outs[-1].token_ids)
    assert [o.logprobs[0].token for o in outs] == tokens
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float(), dim=-1)
    for position, out in enumerate(outs):
        scored = out.logprobs[0]
        assert scored.logprob == pytest.approx(float(expected[position, scored.token]), abs=1e-4)
        best = expected[position].topk(3)
        assert [t for t, _ in scored.top] == best.indices.tolist()
        assert [v for _, v in scored.top] == pytest.approx(best.values.tolist(), abs=1e-4)


async def _outputs(outputs: Any) -> list[Any]:
    return [out async for out in outputs]


def test_a_prompts_logprobs_are_the_models_own_across_its_chunks(checkpoint: Path) -> None:
    """A prompt of 11 tokens, fed in chunks of 4 beside another request, asked with its log-probabilities: the
    first output carries each prompt token's from the second on (the last stage returned every position's
    logits for its chunks), equal to transformers' forward over the prompt; later outputs carry none."""
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]

    async def run() -> list[Any]:
        engine = _engine(checkpoint)
        engine.start()
        beside = asyncio.ensure_future(_outputs(engine.generate([20, 21], 5, Sampling(temperature=0))))
        outs = await _outputs(engine.generate(prompt, 3, Sampling(temperature=0, logprobs=2, prompt_logprobs=True)))
        await beside
        await engine.close()
        return outs

    outs = asyncio.run(run())
    scored = outs[0].prompt_logprobs
    assert [s.token for s in scored] == prompt[1:] and all(o.prompt_logprobs == () for o in outs[1:])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint)).eval()
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for position, item in enumerate(scored):
        assert item.logprob == pytest.approx(float(expected[position, prompt[position + 1]]), abs=1e-4)
        assert [t for t, _ in item.top] == expected[position].topk(2).indices.tolist()
    assert list(outs[-1].token_ids) == asyncio.run(_alone(checkpoint, prompt, 3))  # the answer itself unchanged
