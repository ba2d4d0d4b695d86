"""benchmarks/real_shapes.py at scaled-down sizes (the same writer as the real shapes): transformers loads each family's
folder, the tokenizer has exactly the model's vocabulary, prompts have the token counts asked, greedy tokens vary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from benchmarks.real_shapes import SHAPES, byte_level_core, write_shape
from raycluster_cli.verbs.serve_load import make_requests

SMALL = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3, "vocab_size": 1024}


def small(name: str) -> dict[str, object]:
    """``name``'s shape (family, heads ratio, tying, RoPE) at sizes a unit test writes in a second."""
    shape = SHAPES[name] | SMALL | {"num_attention_heads": 4, "num_key_value_heads": 2}
    return shape | ({"head_dim": 32} if "head_dim" in shape else {})


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_written_shape_loads_in_transformers(tmp_path: Path, name: str) -> None:
    path = write_shape(tmp_path / name, small(name), seed=3)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == SHAPES[name]["family"]
    assert config["vocab_size"] == 1024 and config["dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is SHAPES[name]["tie_word_embeddings"]
    assert config["num_key_value_heads"] == 2
    with safe_open(str(path / "model.safetensors"), "pt") as stored:
        assert {stored.get_slice(k).get_dtype() for k in stored.keys()} == {"BF16"}  # noqa: SIM118
        assert ("lm_head.weight" in stored.keys()) is not SHAPES[name]["tie_word_embeddings"]  # noqa: SIM118
        biased = any(k.endswith("q_proj.bias") for k in stored.keys())  # noqa: SIM118
        assert biased is (SHAPES[name]["family"] == "qwen2")

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert len(tokenizer) == model.config.vocab_size == 1024
    assert model.dtype == torch.bfloat16
    for spec in make_requests(4, seed=1, prompt_tokens=(128, 160), output_tokens=(1, 1), tokens_per_word=1.0):
        assert len(tokenizer(spec.prompt).input_ids) == spec.words  # one token per word: the counts asked
    ids = tokenizer("the cat on a hill and the dog", return_tensors="pt").input_ids
    assert ids.shape[1] == 8
    out = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert len(set(out[0, 8:].tolist())) >= 8, out[0, 8:].tolist()  # greedy does not settle on one token


def test_vocabulary_too_small_for_the_prompts_words_is_refused() -> None:
    with pytest.raises(ValueError, match="vocab_size 300 is too small"):
        byte_level_core(300)
