"""Tiny checkpoints the bench tests write themselves (no download): safetensors files and a random GPT-2."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from raycluster_cli.models.gpt2 import CONFIG_FILE, WEIGHTS_FILE


def save_tensors(path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` as a safetensors file (used by tests to make a tiny model)."""
    save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, str(path), metadata=metadata)


def write_random_gpt2(
    path: str | Path,
    *,
    layers: int = 2,
    d_model: int = 64,
    heads: int = 4,
    vocab: int = 128,
    positions: int = 64,
    seed: int = 0,
) -> Path:
    """Write a tiny randomly initialised GPT-2 checkpoint in Hugging Face layout (for tests and demos)."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    d = d_model
    tensors: dict[str, torch.Tensor] = {"wte.weight": normal(vocab, d, std=0.5), "wpe.weight": normal(positions, d)}
    for i in range(layers):
        tensors |= {
            f"h.{i}.ln_1.weight": 1 + normal(d, std=0.1),
            f"h.{i}.ln_1.bias": normal(d),
            f"h.{i}.attn.c_attn.weight": normal(d, 3 * d, std=0.2),
            f"h.{i}.attn.c_attn.bias": normal(3 * d),
            f"h.{i}.attn.c_proj.weight": normal(d, d, std=0.2),
            f"h.{i}.attn.c_proj.bias": normal(d),
            f"h.{i}.ln_2.weight": 1 + normal(d, std=0.1),
            f"h.{i}.ln_2.bias": normal(d),
            f"h.{i}.mlp.c_fc.weight": normal(d, 4 * d, std=0.2),
            f"h.{i}.mlp.c_fc.bias": normal(4 * d),
            f"h.{i}.mlp.c_proj.weight": normal(4 * d, d, std=0.2),
            f"h.{i}.mlp.c_proj.bias": normal(d),
        }
    tensors |= {"ln_f.weight": 1 + normal(d, std=0.1), "ln_f.bias": normal(d)}
    save_tensors(directory / WEIGHTS_FILE, tensors, {"format": "pt"})
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": vocab,
        "n_positions": positions,
        "n_ctx": positions,
        "n_embd": d,
        "n_layer": layers,
        "n_head": heads,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
    }
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return directory
