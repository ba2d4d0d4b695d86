"""A family added through the registry, served and benchmarked: a tiny random Phi-3 (fused q/k/v and gate/up split
at load, half of each head rotated) behind the real service over HTTP on a throwaway local Ray, two stages, the
real `openai` client; and the same checkpoint through the benchmark's balanced stages with its output checked."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from raycluster_cli.bench import session  # noqa: E402
from raycluster_cli.bench.options import BenchOptions  # noqa: E402
from raycluster_cli.host.containers import SERVE_ENV  # noqa: E402
from raycluster_cli.models.tiny_chat import SPECIALS, WORDS, chat_tokenizer  # noqa: E402
from raycluster_cli.serve.app import build_app  # noqa: E402
from raycluster_cli.serve.scheduler import Limits  # noqa: E402
from raycluster_cli.serve.settings import ServeSettings  # noqa: E402

from ..llama_checkpoint import write_llama  # noqa: E402
from ..local_ray import local_serve, one_node_ray, write_keys  # noqa: E402
from ..text_tokenizers import in_context  # noqa: E402
from .test_serve_openai import TOKEN, _wait_ready  # noqa: E402

MODEL = "tiny-phi3"
PROMPTS = ["the cat sat on the mat", "a dog ran to the red house"]
NEW_TOKENS = 12


def _write(path: Path) -> Path:
    """A random Phi-3 whose vocabulary is the chat tokenizer's, half of each head rotated, its tokenizer beside."""
    ids = {token: index for index, token in enumerate(SPECIALS)}
    write_llama(
        path,
        family="phi3",
        vocab_size=len(SPECIALS) + len(WORDS),
        num_hidden_layers=4,
        max_position_embeddings=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        partial_rotary_factor=0.5,
        pad_token_id=ids["[PAD]"],
        bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"],
    )
    chat_tokenizer().save_pretrained(str(path))
    return path


def _greedy(path: Path, prompts: list[str]) -> list[str]:
    """transformers' greedy text for each prompt, the tokenizer and model loaded once."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    texts = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS)
        texts.append(in_context(tokenizer, ids, out[0, len(ids) :].tolist()))
    return texts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = _write(tmp_path_factory.mktemp("phi3") / MODEL)
    assert transformers.AutoConfig.from_pretrained(str(path)).model_type == "phi3"
    return path


@pytest.fixture
def served(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    settings = ServeSettings(
        model_path=str(checkpoint),
        keys_file=write_keys(tmp_path_factory.mktemp("keys") / "keys.json", {"default": TOKEN}),
        stages=2,
        split=(2, 2),
        num_threads=1,
        model_id=MODEL,
        limits=Limits(slots=4, step_tokens=32, prefill_chunk=16, max_seq=64, max_waiting=8),
    )
    with local_serve(build_app(settings, health_check_period_s=2), SERVE_ENV, num_cpus=3) as root:
        _wait_ready(f"{root}/v1")
        yield f"{root}/v1"


def test_phi3_is_served_over_http_as_transformers_computes_it(served: str, checkpoint: Path) -> None:
    """Both prompts at once through the two stages: each completion is transformers' greedy text."""

    async def both() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=served, api_key=TOKEN, max_retries=0, timeout=120)
        calls = [
            client.completions.create(model=MODEL, prompt=p, max_tokens=NEW_TOKENS, temperature=0) for p in PROMPTS
        ]
        return list(await asyncio.gather(*calls))

    answers = asyncio.run(both())
    assert [a.choices[0].text for a in answers] == _greedy(checkpoint, PROMPTS)


def test_phi3_through_the_benchmarks_balanced_stages_equals_unsharded(checkpoint: Path) -> None:
    options = BenchOptions(
        model_path=str(checkpoint), allow_shared_nodes=True, threads=1, calibration_repeats=1,
        calibration_sample_s=0.01, stages=2, requests=4, prompt_len=5, max_new_tokens=6, micro_batch=2,
        partition="balanced", check_output=True, check_requests=4, references=False,
    )  # fmt: skip
    with one_node_ray(num_cpus=2, _node_ip_address="127.0.0.1"):
        doc = session.run(options, lambda *a, **k: None)
    assert doc["config"]["model_source"] == f"phi3:{checkpoint}"
    assert doc["output_check"] == {"identical": True, "compared_requests": 4, "mismatched": []}
