"""The tiny random Llama with a real tokenizer and chat template that the serve tests write offline: the one
`make demo` serves (raycluster_cli/models/tiny_chat.py), and a checkpoint poisoned into NaN logits."""

from __future__ import annotations

from pathlib import Path

from raycluster_cli.models.tiny_chat import CHAT_TEMPLATE, SPECIALS, WORDS, write_chat_llama

__all__ = ["CHAT_TEMPLATE", "SPECIALS", "WORDS", "poison_embedding", "write_chat_llama"]


def poison_embedding(path: Path, token: int) -> Path:
    """Set the embedding row of ``token`` to NaN in the checkpoint at ``path`` (a real checkpoint whose weights
    turn one token's logits into NaN, as an overflowing half-precision model's do)."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    name = next(n for n in tensors if n.endswith("embed_tokens.weight"))
    tensors[name][token] = float("nan")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    assert torch.isnan(load_file(str(weights))[name][token]).all()
    return path
