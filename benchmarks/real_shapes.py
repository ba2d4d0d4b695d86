"""Random checkpoints in the shapes users serve: what the serving benchmarks (engine_vs_vllm.sh) compare engines on.

A small shape hides what dominates at real scale (a 151 936-row head, its logits, bf16 kernels), so each shape
here is a real model's architecture and sizes, with random weights stored in bfloat16:

- ``qwen2.5-0.5b``: Qwen2, 24 layers x 896, 14 heads / 2 K/V heads, MLP 4864, vocabulary 151 936, tied, q/k/v bias
- ``llama-3.2-1b``: Llama, 16 layers x 2048, 32 / 8 heads, MLP 8192, vocabulary 128 256, tied, llama3 RoPE scaling
- ``tinyllama-1.1b``: Llama, 22 layers x 2048, 32 / 4 heads, MLP 5632, vocabulary 32 000, own head

Tensors are drawn and written one at a time with ``safetensors`` under ``transformers``' names (a 1B model is never
held in float32 whole); config.json is the family's ``transformers`` config, so ``transformers`` and vLLM load the
folder as they load the real model. Scales are fan-in aware (each matrix 1/sqrt(fan-in), a block's output
projections 8/sqrt(fan-in), embeddings 4/sqrt(hidden)): every block's output outweighs the input embedding in the
residual, so a tied head does not keep returning the input token, and logits have a spread near 4, so greedy
tokens vary with the context.

The tokenizer is a ``tokenizers`` byte-level BPE (the kind Qwen2 and Llama 3 ship; ``transformers`` rebuilds a
Qwen2 checkpoint's tokenizer as one whatever its files say) whose vocabulary has exactly the model's size: the
chat specials, the 256 bytes, merges that make each of the serving benchmark's plain words
(raycluster_cli/verbs/serve_load.py) one token, then fillers. A prompt of N words is N tokens, so `bench --serve`'s
prompts (sized from the service's tokens per word) have the counts asked, up to the model's context.

``python benchmarks/real_shapes.py qwen2.5-0.5b DIR`` writes one (``--layers N`` keeps the first N layers).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from raycluster_cli.models.tiny_chat import SPECIALS, fast_tokenizer
from raycluster_cli.verbs.serve_load import WORDS

COMMON = {"hidden_act": "silu", "initializer_range": 0.02, "use_cache": True, "attention_dropout": 0.0}
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        "family": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
    },
    "llama-3.2-1b": {
        "family": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rms_norm_eps": 1e-5,
    },
    "tinyllama-1.1b": {
        "family": "llama",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "tie_word_embeddings": False,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
    },
}
CONFIGS = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM")}
EMBED_GAIN = 4.0  # embedding rows of norm ~4: the logit spread of a tied head (see the module's docstring)
OUT_GAIN = (
    8.0  # each block adds ~8x the input embedding's rms to the residual: a tied head's own-token logit stays small
)
QK_GAIN = 2.0  # attention scores of spread ~4: sharper than an average over the context, so steps differ


def byte_level_core(size: int) -> Any:
    """A byte-level BPE of exactly ``size`` tokens (as Qwen2's and Llama 3's are): the chat specials, the 256 byte
    symbols, merges that make each of the benchmark's words one token (with its leading space, and without it
    for a text's first word), then unreachable ``<|t<N>|>`` fillers up to ``size``."""
    import tokenizers
    from tokenizers import decoders, pre_tokenizers, trainers

    core = tokenizers.Tokenizer(tokenizers.models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator([" ".join(WORDS), *(f"{w} {w}" for w in WORDS)], trainer)
    trained = json.loads(core.to_str())
    vocab: dict[str, int] = trained["model"]["vocab"]
    if len(core.encode(" ".join(WORDS)).ids) != len(WORDS):  # the trainer stopped at ``size`` before every word
        raise ValueError(f"vocab_size {size} is too small for the specials, bytes and one token per prompt word")
    vocab |= {f"<|t{n}|>": len(vocab) + n for n in range(size - len(vocab))}
    return tokenizers.Tokenizer.from_str(json.dumps(trained))


def tokenizer(size: int) -> Any:
    """The byte-level tokenizer of exactly ``size`` tokens, as ``transformers.PreTrainedTokenizerFast``."""
    return fast_tokenizer(byte_level_core(size), unk_token=None)


def config(shape: dict[str, Any]) -> Any:
    """The family's ``transformers`` config for ``shape`` (its ``family`` key names the family), stored bfloat16."""
    import transformers

    settings = {k: v for k, v in shape.items() if k != "family"}
    ids = {t: i for i, t in enumerate(SPECIALS)}
    special = {"bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"], "pad_token_id": ids["[PAD]"]}
    made = getattr(transformers, CONFIGS[shape["family"]][0])(**(COMMON | settings | special))
    made.architectures = [CONFIGS[shape["family"]][1]]
    made.dtype = "bfloat16"
    return made


def tensor_shapes(shape: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint under ``transformers``' name, with its shape."""
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    head_dim = shape.get("head_dim") or h // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    bias = shape["family"] == "qwen2"  # Qwen2's q/k/v projections carry biases
    names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for n in range(shape["num_hidden_layers"]):
        at = f"model.layers.{n}."
        names |= {at + "input_layernorm.weight": (h,), at + "post_attention_layernorm.weight": (h,)}
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            names[at + f"self_attn.{proj}.weight"] = (rows, h)
            if bias:
                names[at + f"self_attn.{proj}.bias"] = (rows,)
        names[at + "self_attn.o_proj.weight"] = (h, q)
        names |= {at + "mlp.gate_proj.weight": (inter, h), at + "mlp.up_proj.weight": (inter, h)}
        names[at + "mlp.down_proj.weight"] = (h, inter)
    names["model.norm.weight"] = (h,)
    if not shape.get("tie_word_embeddings"):
        names["lm_head.weight"] = (vocab, h)
    return names


def draw(name: str, dims: tuple[int, ...], gen: Any) -> Any:
    """One tensor, bfloat16: norms near 1, biases small, embeddings EMBED_GAIN/sqrt(hidden), matrices 1/sqrt(fan-in)."""
    import torch

    if name.endswith("norm.weight"):
        values = 1 + 0.1 * torch.randn(dims, generator=gen)
    elif name.endswith(".bias"):
        values = 0.1 * torch.randn(dims, generator=gen)
    else:
        gain = EMBED_GAIN if "embed_tokens" in name or "lm_head" in name else 1.0
        gain = OUT_GAIN if name.endswith(("o_proj.weight", "down_proj.weight")) else gain
        gain = QK_GAIN if name.endswith(("q_proj.weight", "k_proj.weight")) else gain
        values = torch.randn(dims, generator=gen).mul_(gain / math.sqrt(dims[1]))
    return values.to(torch.bfloat16)


def write_shape(path: Path, shape: dict[str, Any], *, seed: int = 0) -> Path:
    """The checkpoint of ``shape`` (a SHAPES entry, or one with smaller sizes) in ``path``: model.safetensors,
    config.json, generation_config.json and the tokenizer's files."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: draw(name, dims, gen) for name, dims in tensor_shapes(shape).items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    made = config(shape)
    made.save_pretrained(str(path))
    generation = {"bos_token_id": made.bos_token_id, "eos_token_id": made.eos_token_id, "do_sample": False}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer(shape["vocab_size"]).save_pretrained(str(path))
    return path


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("path", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: the shape's own)")
    args = p.parse_args(argv)
    shape = SHAPES[args.shape] | ({"num_hidden_layers": args.layers} if args.layers else {})
    path = write_shape(args.path, shape, seed=args.seed)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    print(f"{path}: {args.shape}, {shape['num_hidden_layers']} layers, {size / 1e9:.2f} GB")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
