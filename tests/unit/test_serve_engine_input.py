"""A request's own bad input fails that request only: the engine (in-process stages, real torch) refuses what it
cannot run before admitting it, and a row whose logits are not numbers ends alone while its batch goes on."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from raycluster_cli.models.batched import BatchedStage  # noqa: E402
from raycluster_cli.models.decoder import config_from_checkpoint  # noqa: E402
from raycluster_cli.serve.engine import BadInput, Engine, RequestFailed  # noqa: E402
from raycluster_cli.serve.scheduler import Limits  # noqa: E402
from raycluster_cli.serve.text import Sampling, bad_logits  # noqa: E402

from ..serve_checkpoint import poison_embedding, write_chat_llama  # noqa: E402
from .test_serve_engine import _InProcessStage  # noqa: E402

POISONED = 20  # a word of the vocabulary whose embedding row is NaN in the poisoned checkpoint
GREEDY = Sampling(temperature=0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same random model twice: as written, and with token POISONED's embedding row NaN."""
    root = tmp_path_factory.mktemp("input")
    return write_chat_llama(root / "clean"), poison_embedding(write_chat_llama(root / "poisoned"), POISONED)


def _engine(path: Path, slots: int = 4) -> Engine:
    cfg = config_from_checkpoint(path, max_seq=64)
    half = 1 + cfg.layers // 2
    stages = [_InProcessStage(BatchedStage(cfg, a, b, slots)) for a, b in ((0, half), (half, cfg.num_units))]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    return Engine(stages, tokenizer, Limits(slots=slots, max_seq=64, prefill_chunk=4), frozenset(), vocab=cfg.vocab)


async def _tokens(outputs: Any) -> list[int]:
    tokens: list[int] = []
    async for out in outputs:
        tokens = list(out.token_ids)
    return tokens


def _idle(engine: Engine) -> bool:
    scheduler = engine.scheduler
    return not scheduler.waiting and not scheduler.running and len(scheduler.free_slots) == scheduler.limits.slots


@pytest.mark.parametrize("bad", [999999999, -5, 2**63])
def test_a_token_outside_the_vocabulary_is_refused_before_admission(checkpoints: tuple[Path, Path], bad: int) -> None:
    async def run() -> tuple[list[int], list[int]]:
        engine = _engine(checkpoints[0])
        engine.start()
        with pytest.raises(BadInput) as refused:
            await _tokens(engine.generate([7, bad, 9], 5, GREEDY))
        assert refused.value.param == "prompt" and str(bad) in str(refused.value)
        assert _idle(engine) and engine.failure is None and engine.steps_done == 0  # it never entered a step
        after = await _tokens(engine.generate([7, 8, 9], 5, GREEDY))
        await engine.close()
        alone = _engine(checkpoints[0])
        alone.start()
        want = await _tokens(alone.generate([7, 8, 9], 5, GREEDY))
        await alone.close()
        return after, want

    after, want = asyncio.run(run())
    assert after == want


def test_a_seed_the_generator_refuses_holds_no_slot(checkpoints: tuple[Path, Path]) -> None:
    """A request refused while being set up (its seed is outside 64 bits) is never admitted: the slots are all
    free after 3 x slots such requests, and a request after them runs."""

    async def run() -> list[int]:
        engine = _engine(checkpoints[0], slots=2)
        engine.start()
        for _ in range(6):
            with pytest.raises(BadInput) as refused:
                await _tokens(engine.generate([7, 8], 5, Sampling(temperature=1.0, seed=2**64)))
            assert refused.value.param == "seed"
        assert _idle(engine) and engine.outstanding == 0
        tokens = await _tokens(engine.generate([7, 8], 3, GREEDY))
        await engine.close()
        return tokens

    assert len(asyncio.run(run())) == 3


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_fail_their_request_only(checkpoints: tuple[Path, Path], temperature: float) -> None:
    """A prompt that holds the poisoned token gets NaN logits: it alone fails (``RequestFailed``, not moved to
    another pipeline); the request beside it, in the same steps, gets exactly the greedy answer of a clean run."""
    clean, poisoned = checkpoints

    async def run() -> tuple[list[int], list[int]]:
        engine = _engine(poisoned)
        engine.start()
        bad = engine.generate([7, POISONED, 9], 8, Sampling(temperature=temperature, seed=1))
        good = engine.generate([11, 12, 13, 14, 15], 8, GREEDY)
        results = await asyncio.gather(_tokens(bad), _tokens(good), return_exceptions=True)
        assert isinstance(results[0], RequestFailed), results[0]
        assert "NaN" in str(results[0])
        assert engine.failure is None and _idle(engine)
        await engine.close()
        reference = _engine(clean)
        reference.start()
        want = await _tokens(reference.generate([11, 12, 13, 14, 15], 8, GREEDY))
        await reference.close()
        return list(results[1]), want  # type: ignore[arg-type]

    got, want = asyncio.run(run())
    assert got == want and len(got) == 8


def test_bad_logits_names_nan_and_plus_inf_but_not_minus_inf() -> None:
    row = torch.zeros(10)
    assert bad_logits(row) is None
    assert bad_logits(row.index_fill(0, torch.tensor([3]), float("-inf"))) is None  # a token made impossible
    assert bad_logits(row.index_fill(0, torch.tensor([3]), float("nan"))) == "NaN"
    assert bad_logits(row.index_fill(0, torch.tensor([3]), float("inf"))) == "+inf"
    assert bad_logits(torch.zeros(3, 10).index_fill(1, torch.tensor([2]), float("nan"))) == "NaN"
