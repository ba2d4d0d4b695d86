"""The GPT-2 family: its units (also the random model's) and its weights in Hugging Face format, unit by unit.

Learned positions, pre-LN blocks, fused QKV, GELU (GPT-2's tanh approximation or exact), tied LM head.  Each
unit has one forward, over rows at their own positions in their own KV slots (``models.rows``); the bench's
micro-batch and the service's mixed steps both run it.

A checkpoint (``config.json`` + ``model.safetensors``) maps onto the units directly:
unit 0 reads ``wte``/``wpe``, unit i reads ``h.{i-1}.*``, the head unit reads ``ln_f`` and the LM
head (``lm_head.weight`` when present, else the tied ``wte.weight``).  GPT-2's ``Conv1D`` layers
store weights as [in, out]; ``nn.Linear`` wants [out, in], so those are transposed on load.  A
stage reads only its own units' tensors (the file is never loaded whole).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from raycluster_cli.models import registry
from raycluster_cli.models.config import ModelConfig
from raycluster_cli.models.matmuls import Matmuls
from raycluster_cli.models.rows import KVCache, Rows
from raycluster_cli.models.tensorfile import TensorFileError, load_tensors, read_header

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = registry.CONFIG_FILE
_ACTIVATIONS = {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu_fast": "gelu_new", "gelu": "gelu"}
# block parameter -> (GPT-2 tensor suffix, transposed?)
_BLOCK_MAP = {
    "ln1.weight": ("ln_1.weight", False),
    "ln1.bias": ("ln_1.bias", False),
    "qkv.weight": ("attn.c_attn.weight", True),
    "qkv.bias": ("attn.c_attn.bias", False),
    "proj.weight": ("attn.c_proj.weight", True),
    "proj.bias": ("attn.c_proj.bias", False),
    "ln2.weight": ("ln_2.weight", False),
    "ln2.bias": ("ln_2.bias", False),
    "fc1.weight": ("mlp.c_fc.weight", True),
    "fc1.bias": ("mlp.c_fc.bias", False),
    "fc2.weight": ("mlp.c_proj.weight", True),
    "fc2.bias": ("mlp.c_proj.bias", False),
}


def config_from_dir(path: str | Path, max_seq: int, seed: int = 0) -> ModelConfig:
    """The ModelConfig of the GPT-2 checkpoint in ``path`` (KV cache and positions sized to ``max_seq``)."""
    directory = Path(path)
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise ValueError(
                f"--model-path {directory}: {needed.name} not found (needs config.json + model.safetensors)"
            )
    try:
        raw: dict[str, Any] = json.loads(config_file.read_text())
    except ValueError as exc:
        raise ValueError(f"{config_file}: not JSON ({exc})") from None
    model_type = raw.get("model_type", "gpt2")
    if model_type not in registry.model_types("gpt2"):
        raise ValueError(f"{config_file}: model_type {model_type!r} is not {' or '.join(registry.model_types('gpt2'))}")
    if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("reorder_and_upcast_attn"):
        raise ValueError(f"{config_file}: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
    activation = _ACTIVATIONS.get(str(raw.get("activation_function", "gelu_new")))
    if activation is None:
        raise ValueError(f"{config_file}: activation_function {raw.get('activation_function')!r} is not supported")
    positions = int(raw.get("n_positions", raw.get("n_ctx", 1024)))
    if max_seq > positions:
        raise ValueError(
            f"prompt + new tokens ({max_seq}) exceed the model's {positions} positions: pass --max-seq {positions}"
        )
    try:
        return ModelConfig(
            vocab=int(raw["vocab_size"]),
            d_model=int(raw["n_embd"]),
            heads=int(raw["n_head"]),
            layers=int(raw["n_layer"]),
            max_seq=max_seq,
            seed=seed,
            activation=activation,
            ln_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
            model_path=str(directory),
        )
    except KeyError as exc:
        raise ValueError(f"{config_file}: missing {exc.args[0]}") from None


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq, cfg.d_model)

    def forward(self, ids: torch.Tensor, rows: Rows) -> torch.Tensor:
        out: torch.Tensor = self.tok(ids) + self.pos(rows.positions)
        return out


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention (with KV cache) + GELU MLP."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.heads
        self.gelu_approximate = "tanh" if cfg.activation == "gelu_new" else "none"
        self.ln1 = nn.LayerNorm(d, eps=cfg.ln_eps)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d, eps=cfg.ln_eps)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, cache: KVCache, rows: Rows, mm: Matmuls) -> torch.Tensor:
        """``x`` the rows' tokens at their own positions (``rows``: [B, T, d] padded, or [N, d] packed); products
        in ``mm``'s measured forms."""
        qkv = mm.apply(self.qkv, self.ln1(x))
        q, k, v = (rows.heads(t, self.heads) for t in qkv.split(x.shape[-1], -1))
        rows.write(cache, k, v)
        att = rows.attend(q, cache)
        x = x + mm.apply(self.proj, rows.merge(att))
        hidden = F.gelu(mm.apply(self.fc1, self.ln2(x)), approximate=self.gelu_approximate)
        out: torch.Tensor = x + mm.apply(self.fc2, hidden)
        return out


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor, mm: Matmuls) -> torch.Tensor:
        out: torch.Tensor = mm.apply(self.lm_head, self.ln_f(x))
        return out


def _prefix(names: set[str]) -> str:
    """``transformer.`` when the checkpoint was saved from GPT2LMHeadModel, else nothing."""
    return "transformer." if "transformer.wte.weight" in names else ""


def unit_tensors(cfg: ModelConfig, unit: int, names: set[str]) -> dict[str, tuple[str, bool]]:
    """For one unit: our parameter name -> (tensor name in the file, transpose?)."""
    pre = _prefix(names)
    if unit == 0:
        return {"tok.weight": (f"{pre}wte.weight", False), "pos.weight": (f"{pre}wpe.weight", False)}
    if unit == cfg.head_unit:
        head = "lm_head.weight" if "lm_head.weight" in names else f"{pre}wte.weight"
        return {
            "ln_f.weight": (f"{pre}ln_f.weight", False),
            "ln_f.bias": (f"{pre}ln_f.bias", False),
            "lm_head.weight": (head, False),
        }
    return {ours: (f"{pre}h.{unit - 1}.{theirs}", t) for ours, (theirs, t) in _BLOCK_MAP.items()}


@torch.no_grad()
def load_units(cfg: ModelConfig, modules: Mapping[int, nn.Module]) -> None:
    """Fill each unit's module from ``cfg.model_path``, one tensor at a time, reading only its units' tensors
    (so loading holds at most one raw tensor beside the weights)."""
    weights = Path(cfg.model_path) / WEIGHTS_FILE
    header = read_header(weights)
    names = set(header)
    for unit, module in modules.items():
        plan = unit_tensors(cfg, unit, names)
        params = dict(module.named_parameters())
        if set(params) != set(plan):
            raise TensorFileError(f"unit {unit}: parameters {sorted(params)} do not match the GPT-2 layout")
        for ours, (src, transpose) in plan.items():  # one tensor in memory at a time beside the weights
            value = load_tensors(weights, [src])[src]
            if transpose:
                value = value.t()
            if ours == "pos.weight":
                value = value[: cfg.max_seq]
            if tuple(value.shape) != tuple(params[ours].shape):
                raise TensorFileError(
                    f"{weights}: {src} has shape {tuple(value.shape)}, unit {unit} needs {tuple(params[ours].shape)}"
                )
            params[ours].copy_(value)
