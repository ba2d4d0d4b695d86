"""Where a step's tokens are sampled (real torch, the engine over in-process ``BatchedStage``s): on the last stage,
which then returns one int64 token a row, unless some row needs the logits themselves (log-probabilities); then
the step comes back as logits and the engine samples its rows with the same function, to the same tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from raycluster_cli.models.batched import BatchedStage  # noqa: E402
from raycluster_cli.models.decoder import config_from_checkpoint  # noqa: E402
from raycluster_cli.serve.engine import Engine, Resume  # noqa: E402
from raycluster_cli.serve.scheduler import Limits  # noqa: E402
from raycluster_cli.serve.text import Sampling  # noqa: E402

from ..serve_checkpoint import write_chat_llama  # noqa: E402
from .test_serve_engine import _InProcessStage, _Method  # noqa: E402

PROMPTS = ([5, 6, 7, 8, 9], [12, 13], [30, 31, 32, 33])
SEEDED = [Sampling(temperature=0.9, top_p=0.9, seed=s) for s in (1, 2, 3)]


class _RecordingStage:
    """A stage actor's handle over a real ``BatchedStage`` that keeps what each forward returned: the payload the
    engine receives from the last stage."""

    def __init__(self, stage: BatchedStage) -> None:
        self.returned: list[torch.Tensor] = []

        def forward(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
            out = stage.forward(x, table)
            self.returned.append(out)
            return out

        self.forward = _Method(forward)
        self.release = _Method(stage.release)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_llama(tmp_path_factory.mktemp("sampling") / "ckpt")


def _engine(path: Path) -> tuple[Engine, _RecordingStage]:
    cfg = config_from_checkpoint(path, max_seq=64)
    half = 1 + cfg.layers // 2
    first, last = BatchedStage(cfg, 0, half, 4), BatchedStage(cfg, half, cfg.num_units, 4)
    recorder = _RecordingStage(last)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    limits = Limits(slots=4, max_seq=64, prefill_chunk=4)
    return Engine([_InProcessStage(first), recorder], tokenizer, limits, frozenset(), vocab=cfg.vocab), recorder


async def _tokens(outputs: Any) -> list[int]:
    tokens: list[int] = []
    async for out in outputs:
        tokens = list(out.token_ids)
    return tokens


async def _together(path: Path, requests: list[tuple[list[int], int, Sampling]]) -> tuple[list[list[int]], Any]:
    engine, recorder = _engine(path)
    engine.start()
    got = await asyncio.gather(*(_tokens(engine.generate(p, n, s)) for p, n, s in requests))
    await engine.close()
    return list(got), (engine.shipped, recorder.returned)


def test_steps_without_logprobs_come_back_as_token_ids(checkpoint: Path) -> None:
    requests = [(list(p), 8, s) for p, s in zip(PROMPTS, SEEDED, strict=True)]
    got, (shipped, returned) = asyncio.run(_together(checkpoint, requests))
    assert all(len(t) == 8 for t in got)
    assert returned and all(r.dtype == torch.int64 and r.dim() == 1 for r in returned)  # [rows], no vocabulary
    assert shipped == {"ids": len(returned)}
    # each seeded request gets the same tokens alone as beside the others
    for (prompt, n, sampling), tokens in zip(requests, got, strict=True):
        alone, _ = asyncio.run(_together(checkpoint, [(prompt, n, sampling)]))
        assert alone == [tokens]


def test_a_logprobs_request_makes_its_steps_ship_logits_and_the_others_tokens_do_not_change(checkpoint: Path) -> None:
    requests = [(list(p), 8, s) for p, s in zip(PROMPTS, SEEDED, strict=True)]
    ids_only, _ = asyncio.run(_together(checkpoint, requests))
    scored = ([40, 41, 42], 10, Sampling(temperature=0.8, seed=9, logprobs=2))
    mixed, (shipped, returned) = asyncio.run(_together(checkpoint, [*requests, scored]))
    assert mixed[:3] == ids_only  # sampled by the engine from the logits, to the tokens the last stage drew
    assert shipped["logits"] > 0 and any(r.is_floating_point() and r.dim() == 2 and len(r) > 1 for r in returned)
    assert sum(shipped.values()) == len(returned)
    alone, _ = asyncio.run(_together(checkpoint, [scored]))
    assert alone == [mixed[3]]
    greedy = (list(PROMPTS[0]), 8, Sampling(temperature=0))
    with_penalty = (list(PROMPTS[1]), 8, Sampling(temperature=0.9, seed=4, presence_penalty=0.5))
    both, (shipped, _) = asyncio.run(_together(checkpoint, [greedy, with_penalty]))
    alone_greedy, _ = asyncio.run(_together(checkpoint, [greedy]))
    assert shipped["logits"] > 0 and both[0] == alone_greedy[0]  # a penalty's request ships logits too


def test_a_seeded_request_resumed_on_another_engine_goes_on_with_the_same_tokens(checkpoint: Path) -> None:
    """Failover: another pipeline prefills the prompt and the tokens sent so far, and draws what follows at the
    same seed and positions, so the client's stream goes on as it would have."""
    prompt, sampling = list(PROMPTS[0]), SEEDED[0]
    (whole,), _ = asyncio.run(_together(checkpoint, [(prompt, 8, sampling)]))

    async def resumed() -> list[int]:
        engine, _ = _engine(checkpoint)
        engine.start()
        outputs = engine.generate(prompt, 8, sampling, resume=Resume(tuple(whole[:3]), 0))
        tokens = await _tokens(outputs)
        await engine.close()
        return tokens

    assert asyncio.run(resumed()) == whole


def test_a_seed_past_2_63_draws_as_its_64_bit_pattern(checkpoint: Path) -> None:
    """Choice i of a seeded request draws at seed + i, which may pass 2**63 - 1: it runs, as the int64 with its
    bits (the step table's), and a seed outside 64 bits stays refused (test_serve_engine_input)."""
    unsigned = Sampling(temperature=1.0, seed=2**63 + 5)
    signed = Sampling(temperature=1.0, seed=2**63 + 5 - 2**64)
    (a,), _ = asyncio.run(_together(checkpoint, [(list(PROMPTS[1]), 4, unsigned)]))
    (b,), _ = asyncio.run(_together(checkpoint, [(list(PROMPTS[1]), 4, signed)]))
    assert len(a) == 4 and a == b
