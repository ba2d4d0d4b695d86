"""How a generation ends and what its last text holds, on the engine's real loop (in-process stages, no Ray)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from raycluster_cli.models.batched import BatchedStage  # noqa: E402
from raycluster_cli.models.decoder import config_from_checkpoint  # noqa: E402
from raycluster_cli.serve.engine import Engine, Output  # noqa: E402
from raycluster_cli.serve.scheduler import Limits  # noqa: E402
from raycluster_cli.serve.text import Sampling  # noqa: E402

from ..serve_checkpoint import write_chat_llama  # noqa: E402
from .test_serve_engine import _InProcessStage  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_chat_llama(tmp_path_factory.mktemp("finish") / "ckpt")


def _run(path: Path, prompt: list[int], limit: int, sampling: Sampling, stop: list[str]) -> list[Output]:
    async def run() -> list[Output]:
        cfg = config_from_checkpoint(path, max_seq=64)
        stages = [_InProcessStage(BatchedStage(cfg, 0, cfg.num_units, 2))]
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        eos = frozenset({tokenizer.eos_token_id})
        engine = Engine(stages, tokenizer, Limits(slots=2, max_seq=64, prefill_chunk=8), eos)
        engine.start()
        return [out async for out in engine.generate(prompt, limit, sampling, stop)]

    return asyncio.run(run())


def test_a_stop_string_in_the_last_allowed_tokens_text_finishes_with_stop(checkpoint: Path) -> None:
    greedy = Sampling(temperature=0, ignore_eos=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    prompt = tokenizer.encode("the cat run to")
    full = _run(checkpoint, prompt, 6, greedy, [])
    words = "".join(o.text for o in full).split()
    last = next(k for k in range(len(words) - 1, 0, -1) if words[k] not in words[:k])  # new only at its token
    outs = _run(checkpoint, prompt, last + 1, greedy, [" " + words[last]])
    assert outs[-1].finish_reason == "stop"  # not "length": the stop string ended it
    assert "".join(o.text for o in outs).split() == words[:last]


@pytest.mark.parametrize("include", [False, True])
def test_the_eos_text_is_left_out_unless_the_stop_goes_in_the_output(checkpoint: Path, include: bool) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    eos = tokenizer.eos_token_id
    forced = Sampling(
        temperature=0, logit_bias=((eos, 100.0),), skip_special_tokens=False, include_stop_str_in_output=include
    )
    outs = _run(checkpoint, tokenizer.encode("the cat"), 5, forced, [])
    assert outs[-1].finish_reason == "stop" and list(outs[-1].token_ids) == [eos]
    assert "".join(o.text for o in outs) == (" </s>" if include else "")
