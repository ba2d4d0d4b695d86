"""The served path on a Phi-3 checkpoint: the engine, over two in-process batched stages, answers two greedy
requests side by side with exactly the tokens ``transformers``' own Phi3ForCausalLM picks (fused q/k/v and
gate/up split at load, half of each head rotated, a sliding window shorter than the answers)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from raycluster_cli.models.batched import BatchedStage  # noqa: E402
from raycluster_cli.models.decoder import config_from_checkpoint  # noqa: E402
from raycluster_cli.models.tiny_chat import SPECIALS, WORDS, chat_tokenizer  # noqa: E402
from raycluster_cli.serve.engine import Engine  # noqa: E402
from raycluster_cli.serve.scheduler import Limits  # noqa: E402
from raycluster_cli.serve.text import Sampling  # noqa: E402

from ..llama_checkpoint import write_llama  # noqa: E402
from .test_serve_engine import _InProcessStage, _tokens  # noqa: E402

PHI3 = {"num_attention_heads": 4, "num_key_value_heads": 2, "partial_rotary_factor": 0.5, "sliding_window": 6}
PROMPTS, NEW = ([5, 6, 7, 8, 9, 10, 11], [12, 13, 14]), 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_llama(
        tmp_path_factory.mktemp("phi3") / "ckpt", seed=5, family="phi3", vocab_size=len(SPECIALS) + len(WORDS), **PHI3
    )
    chat_tokenizer().save_pretrained(str(path))
    return path


def _theirs(path: Path, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens, recomputing the whole sequence each step."""
    model = transformers.Phi3ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(NEW):
            ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


async def _served(path: Path) -> list[list[int]]:
    cfg = config_from_checkpoint(path, max_seq=32)
    half = 1 + cfg.layers // 2
    stages = [_InProcessStage(BatchedStage(cfg, a, b, 2)) for a, b in ((0, half), (half, cfg.num_units))]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    engine = Engine(stages, tokenizer, Limits(slots=2, max_seq=32, prefill_chunk=4), frozenset())
    engine.start()
    try:
        runs = [_tokens(engine.generate(list(p), NEW, Sampling(temperature=0))) for p in PROMPTS]
        return list(await asyncio.gather(*runs))
    finally:
        await engine.close()


def test_served_phi3_gives_transformers_greedy_tokens(checkpoint: Path) -> None:
    cfg = config_from_checkpoint(checkpoint, max_seq=32)
    assert (cfg.family, cfg.rotary_width, cfg.sliding_window) == ("phi3", cfg.dim_per_head // 2, 6)
    served = asyncio.run(_served(checkpoint))
    theirs = [_theirs(checkpoint, list(p)) for p in PROMPTS]
    assert served == theirs
    assert len({t for row in theirs for t in row}) > 3  # not a degenerate model that repeats one token
