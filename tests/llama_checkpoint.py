"""Tiny random Llama, Qwen2, Mistral and Phi-3 checkpoints written by ``transformers`` itself (real tensor names, real
config.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from raycluster_cli.models.tiny_chat import randomize

# grouped-query attention (4 query heads share 2 K/V heads), own LM head, plain RoPE
GQA = {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
# tied head, biases, head_dim that is not hidden/heads, Llama 3.1's rope scaling, one K/V head
VARIANT = {
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "tie_word_embeddings": True,
    "attention_bias": True,
    "mlp_bias": True,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}


# family -> (config class, model class) in transformers
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}
# settings a family's config needs at this size (Phi-3's default pad token 32000 is outside a 96-token vocabulary)
FAMILY_SETTINGS: dict[str, dict[str, Any]] = {"phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}}


def model_class(family: str) -> Any:
    return getattr(transformers, FAMILIES[family][1])


def write_llama(
    path: Path,
    *,
    seed: int = 0,
    shard: str | None = None,
    dtype: Any = None,
    family: str = "llama",
    **extra: Any,
) -> Path:
    """A random model of ``family`` (Llama's block shape) saved by transformers; weights drawn wide enough that
    greedy tokens vary."""
    settings = (
        {
            "vocab_size": 96,
            "hidden_size": 48,
            "intermediate_size": 80,
            "num_hidden_layers": 3,
            "max_position_embeddings": 64,
            "rms_norm_eps": 1e-5,
        }
        | FAMILY_SETTINGS.get(family, {})
        | extra
    )
    torch.manual_seed(seed)
    config_class, _ = FAMILIES[family]
    model = model_class(family)(getattr(transformers, config_class)(**settings)).eval()
    randomize(model, seed)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(path), **({"max_shard_size": shard} if shard else {}))
    return path
