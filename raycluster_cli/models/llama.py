"""The Llama architecture (Hugging Face ``LlamaForCausalLM``): its units, and its checkpoints unit by unit.

Qwen2 (``Qwen2ForCausalLM``) and Mistral (``MistralForCausalLM``) are the same blocks with other
settings: Qwen2's q/k/v projections have biases and its output projection none; Mistral (and a Qwen2
that turns ``use_sliding_window`` on) lets a query see only the last ``sliding_window`` keys.  A window
at least as long as the run's ``max_seq`` cannot hide any key, so it is dropped from the config (the
same tokens, as the tests check); a shorter one is applied to the attention mask, as transformers does.
Phi-3 (``Phi3ForCausalLM``) is Mistral's blocks with q/k/v stored as one ``qkv_proj`` and gate/up as one
``gate_up_proj``: the loader splits them into the block's own projections (so there is one forward), and a
``partial_rotary_factor`` below 1 rotates only each head's leading dims.  Its long-context RoPE
(``longrope``) is refused, naming config.json's rope_scaling.

The units line up with GPT-2's (``gpt2.py``): unit 0 is the token embedding (no position table:
positions enter every block as rotations of the queries and keys, RoPE), units 1..L are the blocks
(RMSNorm → grouped-query attention → RMSNorm → SwiGLU MLP, no biases unless the config asks), and
unit L+1 is the final RMSNorm + LM head (its own ``lm_head.weight``, or the token embedding when
``tie_word_embeddings``).  A stage reads only its own units' tensors, also from a checkpoint saved in
shards (``model.safetensors.index.json``).  The maths follows ``transformers``' modeling_llama so a
loaded checkpoint produces the same tokens (the unit tests compare the two).  Each unit has one forward, over
rows at their own positions in their own KV slots (``models.rows``): the bench's micro-batch and the service's
mixed steps both run it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from raycluster_cli.models import registry
from raycluster_cli.models.config import ModelConfig
from raycluster_cli.models.matmuls import Matmuls
from raycluster_cli.models.registry import CONFIG_FILE, read_config
from raycluster_cli.models.rows import KVCache, Rows
from raycluster_cli.models.tensorfile import TensorFileError, checkpoint_tensors, load_checkpoint_tensors

# block parameter -> Llama tensor suffix (biases only exist with attention_bias / mlp_bias)
_BLOCK_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "q.weight": "self_attn.q_proj.weight",
    "q.bias": "self_attn.q_proj.bias",
    "k.weight": "self_attn.k_proj.weight",
    "k.bias": "self_attn.k_proj.bias",
    "v.weight": "self_attn.v_proj.weight",
    "v.bias": "self_attn.v_proj.bias",
    "o.weight": "self_attn.o_proj.weight",
    "o.bias": "self_attn.o_proj.bias",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "gate.weight": "mlp.gate_proj.weight",
    "gate.bias": "mlp.gate_proj.bias",
    "up.weight": "mlp.up_proj.weight",
    "up.bias": "mlp.up_proj.bias",
    "down.weight": "mlp.down_proj.weight",
    "down.bias": "mlp.down_proj.bias",
}
# Phi-3: a fused tensor (suffix) -> our projections stored in it, in its row order
_FUSED = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}


def _rope(raw: dict[str, Any], config_file: Path) -> tuple[float, str]:
    """(rope_theta, rope scaling as canonical JSON or "") from the new (``rope_parameters``) or old
    (``rope_theta`` + ``rope_scaling``) spelling of the config."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = str(params.get("rope_type", params.get("type", "default")))
    if kind in ("longrope", "su", "yarn"):
        raise ValueError(
            f"{config_file}: rope_scaling {kind!r} (long-context RoPE) is not supported;"
            " use a checkpoint whose config.json has no rope_scaling (such as Phi-3-mini-4k-instruct)"
        )
    if kind == "default":
        return theta, ""
    if kind == "linear":
        return theta, json.dumps({"rope_type": kind, "factor": float(params["factor"])})
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor")
        scaling: dict[str, Any] = {"rope_type": kind} | {k: float(params[k]) for k in keys}
        original = params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 2048))
        scaling["original_max_position_embeddings"] = int(original)
        return theta, json.dumps(scaling, sort_keys=True)
    raise ValueError(f"{config_file}: rope scaling {kind!r} is not supported (default, linear, llama3)")


FAMILIES = registry.model_types("llama")  # the model types that run on these units


def _sliding_window(raw: dict[str, Any], family: str, max_seq: int, config_file: Path) -> tuple[int, int]:
    """(window, first block it applies to) from Mistral's or Qwen2's config; (0, 0) when no key can fall out
    of the window within ``max_seq`` positions."""
    window = raw.get("sliding_window")
    if family == "qwen2" and not raw.get("use_sliding_window", False):
        window = None
    if family == "llama" or window is None or int(window) >= max_seq:
        return 0, 0
    layers = int(raw["num_hidden_layers"])
    first = int(raw.get("max_window_layers", 0)) if family == "qwen2" else 0
    types = raw.get("layer_types")
    if family == "qwen2" and types is not None:
        first = sum(1 for kind in types if kind == "full_attention")
        if list(types) != ["full_attention"] * first + ["sliding_attention"] * (layers - first):
            raise ValueError(f"{config_file}: layer_types {types} (full layers, then sliding ones, are supported)")
    return int(window), min(first, layers)


def _rotary_dim(raw: dict[str, Any], family: str, head_dim: int, config_file: Path) -> int:
    """The leading dims of each head RoPE rotates: Phi-3's ``partial_rotary_factor`` (0: the whole head)."""
    if family != "phi3":
        return 0
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    dim = int(head_dim * factor)
    if dim % 2 or not 0 < dim <= head_dim:
        raise ValueError(
            f"{config_file}: partial_rotary_factor {factor} gives {dim} rotary dims of {head_dim}: need an even count"
        )
    return 0 if dim == head_dim else dim


def config_from_dir(path: str | Path, max_seq: int, seed: int = 0) -> ModelConfig:
    """The ModelConfig of the Llama, Qwen2, Mistral or Phi-3 checkpoint in ``path`` (KV cache and rotary tables sized
    to ``max_seq``)."""
    directory = Path(path)
    raw = read_config(directory)
    config_file = directory / CONFIG_FILE
    known = registry.model_type_of({"architectures": raw.get("architectures")})
    family = str(raw.get("model_type") or (known.model_type if known else "llama"))
    if family not in FAMILIES:
        raise ValueError(f"{config_file}: model_type {family!r} is not one of {', '.join(FAMILIES)}")
    checkpoint_tensors(directory)  # fails early, naming the directory, when there are no weights
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{config_file}: hidden_act {raw.get('hidden_act')!r} is not supported (silu)")
    positions = int(raw.get("max_position_embeddings", 2048))
    if max_seq > positions:
        raise ValueError(
            f"prompt + new tokens ({max_seq}) exceed the model's {positions} positions: pass --max-seq {positions}"
        )
    try:
        heads = int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // heads)
        theta, scaling = _rope(raw, config_file)
        window, window_from = _sliding_window(raw, family, max_seq, config_file)
        return ModelConfig(
            vocab=int(raw["vocab_size"]),
            d_model=int(raw["hidden_size"]),
            heads=heads,
            layers=int(raw["num_hidden_layers"]),
            max_seq=max_seq,
            seed=seed,
            activation="silu",
            ln_eps=float(raw.get("rms_norm_eps", 1e-6)),
            model_path=str(directory),
            arch="llama",
            kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            ffn=int(raw["intermediate_size"]),
            rope_theta=theta,
            rope_scaling=scaling,
            attention_bias=family == "llama" and bool(raw.get("attention_bias", False)),
            mlp_bias=family == "llama" and bool(raw.get("mlp_bias", False)),
            tied_head=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",
            sliding_window=window,
            window_from_layer=window_from,
            family="" if family == "llama" else family,
            rotary_dim=_rotary_dim(raw, family, head_dim, config_file),
        )
    except KeyError as exc:
        raise ValueError(f"{config_file}: missing {exc.args[0]}") from None


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """RoPE's per-pair rotation speeds, with the checkpoint's scaling (as ``transformers`` computes them)."""
    dim = cfg.rotary_width
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    params = cfg.rope_params
    if cfg.rope_type == "linear":
        return inv_freq / params["factor"]
    if cfg.rope_type != "llama3":
        return inv_freq
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(medium, smoothed, scaled)


def rotary_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position < max_seq: [max_seq, rotary_width] each."""
    freqs = torch.arange(cfg.max_seq, dtype=torch.float32)[:, None] * inverse_frequencies(cfg)[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the leading ``cos.shape[-1]`` dims of each head; the others pass through (partial rotary)."""
    width = cos.shape[-1]
    if width < x.shape[-1]:
        return torch.cat((_rotate(x[..., :width], cos, sin), x[..., width:]), dim=-1)
    half = width // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' LlamaRMSNorm: normalized in float32, scaled by the weight in the model's dtype (torch's
        fused ``rms_norm`` for the float32 part: one call where the formula spelled out takes five)."""
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        out: torch.Tensor = self.weight * normed.to(x.dtype)
        return out


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)

    def forward(self, ids: torch.Tensor, rows: Rows) -> torch.Tensor:
        """No positions here: they enter every block as rotations (RoPE)."""
        out: torch.Tensor = self.tok(ids)
        return out


class Block(nn.Module):
    """RMSNorm → causal grouped-query attention with RoPE (KV cache of ``kv_heads``) → RMSNorm → SwiGLU."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        d, width = cfg.d_model, cfg.dim_per_head
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.num_kv_heads, width
        self.window = cfg.window_of(layer)
        qkv_bias = cfg.attention_bias or cfg.qkv_bias
        self.attn_norm = RMSNorm(d, cfg.ln_eps)
        self.q = nn.Linear(d, cfg.heads * width, bias=qkv_bias)
        self.k = nn.Linear(d, self.kv_heads * width, bias=qkv_bias)
        self.v = nn.Linear(d, self.kv_heads * width, bias=qkv_bias)
        self.o = nn.Linear(cfg.heads * width, d, bias=cfg.attention_bias)
        self.mlp_norm = RMSNorm(d, cfg.ln_eps)
        self.gate = nn.Linear(d, cfg.mlp_width, bias=cfg.mlp_bias)
        self.up = nn.Linear(d, cfg.mlp_width, bias=cfg.mlp_bias)
        self.down = nn.Linear(cfg.mlp_width, d, bias=cfg.mlp_bias)
        cos, sin = rotary_tables(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, cache: KVCache, rows: Rows, mm: Matmuls) -> torch.Tensor:
        """``x`` the rows' tokens at their own positions (``rows``: [B, T, d] padded, or [N, d] packed); products
        in ``mm``'s measured forms."""
        heads, kv_heads = self.heads, self.kv_heads
        h = self.attn_norm(x)
        q = rows.heads(mm.apply(self.q, h), heads)
        k = rows.heads(mm.apply(self.k, h), kv_heads)
        v = rows.heads(mm.apply(self.v, h), kv_heads)
        cos, sin = rows.rotary(self.cos, self.sin)
        rows.write(cache, _rotate(k, cos, sin), v)
        att = rows.attend(_rotate(q, cos, sin), cache, self.window, gqa=kv_heads != heads)
        x = x + mm.apply(self.o, rows.merge(att))
        h = self.mlp_norm(x)
        out: torch.Tensor = x + mm.apply(self.down, F.silu(mm.apply(self.gate, h)) * mm.apply(self.up, h))
        return out


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.ln_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor, mm: Matmuls) -> torch.Tensor:
        out: torch.Tensor = mm.apply(self.lm_head, self.norm(x))
        return out


def _fused_rows(cfg: ModelConfig, prefix: str) -> dict[str, tuple[str, slice]]:
    """Phi-3's fused projections: q, k and v are consecutive row ranges of ``qkv_proj``, gate and up the two
    halves of ``gate_up_proj`` (the order transformers' Phi3 splits them in)."""
    kv = cfg.num_kv_heads * cfg.dim_per_head
    sizes = {"q": cfg.heads * cfg.dim_per_head, "k": kv, "v": kv, "gate": cfg.mlp_width, "up": cfg.mlp_width}
    plan = {}
    for fused, parts in _FUSED.items():
        start = 0
        for part in parts:
            plan[f"{part}.weight"] = (f"{prefix}{fused}.weight", slice(start, start + sizes[part]))
            start += sizes[part]
    return plan


def unit_tensors(cfg: ModelConfig, unit: int, names: set[str]) -> dict[str, tuple[str, slice]]:
    """For one unit: our parameter name -> (tensor name in the checkpoint, the rows of it that are ours)."""
    pre, whole = ("model." if "model.embed_tokens.weight" in names else ""), slice(None)
    if unit == 0:
        return {"tok.weight": (f"{pre}embed_tokens.weight", whole)}
    if unit == cfg.head_unit:
        head = f"{pre}embed_tokens.weight" if cfg.tied_head else "lm_head.weight"
        return {"norm.weight": (f"{pre}norm.weight", whole), "lm_head.weight": (head, whole)}
    biases = {"q", "k", "v", "o"} if cfg.attention_bias else {"q", "k", "v"} if cfg.qkv_bias else set()
    biases |= {"gate", "up", "down"} if cfg.mlp_bias else set()
    prefix = f"{pre}layers.{unit - 1}."
    plan = {
        ours: (prefix + theirs, whole)
        for ours, theirs in _BLOCK_MAP.items()
        if ours.endswith("weight") or ours.split(".")[0] in biases
    }
    return plan | _fused_rows(cfg, prefix) if cfg.family == "phi3" else plan


@torch.no_grad()
def load_units(cfg: ModelConfig, modules: Mapping[int, nn.Module]) -> None:
    """Fill each unit's module from ``cfg.model_path``, one checkpoint tensor at a time (a fused one once for
    all its parts), reading only that unit's tensors."""
    files = checkpoint_tensors(cfg.model_path)
    names = set(files)
    for unit, module in modules.items():
        plan = unit_tensors(cfg, unit, names)
        params = dict(module.named_parameters())
        if set(params) != set(plan):
            raise TensorFileError(
                f"unit {unit}: parameters {sorted(params)} do not match the {cfg.family or 'llama'} layout"
            )
        parts: dict[str, list[str]] = {}
        for ours, (src, _) in plan.items():
            parts.setdefault(src, []).append(ours)
        for src, ours_list in parts.items():  # one checkpoint tensor in memory at a time beside the weights
            value = load_checkpoint_tensors(files, [src])[src]
            first = params[ours_list[0]]
            wanted = (sum(params[ours].shape[0] for ours in ours_list), *first.shape[1:])
            if tuple(value.shape) != wanted:
                raise TensorFileError(
                    f"{cfg.model_path}: {src} has shape {tuple(value.shape)}, unit {unit} needs {wanted}"
                )
            for ours in ours_list:
                params[ours].copy_(value[plan[ours][1]])
