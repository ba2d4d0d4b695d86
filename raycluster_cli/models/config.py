"""The shape of the benchmark's decoder: ``ModelConfig`` (shared by the model and the checkpoint loaders)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from raycluster_cli.models.registry import ARCHITECTURES

DTYPES = ("float32", "bfloat16", "float16")  # what weights, KV cache and activations are held and computed in
QUANTIZE = ("", "int8")  # "": products in the dtype; "int8": a CPU stage's products with int8 weights (models.int8)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ACTIVATIONS = ("gelu", "gelu_new")
_LLAMA_ROPE = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder.  ``max_seq`` bounds prompt + generated tokens (position table, KV cache).

    ``arch`` picks the block: ``gpt2`` (learned positions, LayerNorm, GELU MLP) or ``llama`` (rotary
    positions, RMSNorm, SwiGLU MLP, grouped-query attention; also Qwen2's and Mistral's, which differ
    only in biases and the sliding window, and Phi-3's, whose fused projections are split at load and which
    may rotate only part of each head); the fields after ``model_path`` are Llama's and keep their
    defaults for GPT-2.
    """

    vocab: int = 4096
    d_model: int = 256
    heads: int = 4
    layers: int = 12
    max_seq: int = 128
    seed: int = 0
    activation: str = "gelu"  # "gelu" (exact) or "gelu_new" (GPT-2's tanh approximation); llama: "silu"
    ln_eps: float = 1e-5  # LayerNorm eps (gpt2) or RMSNorm eps (llama)
    model_path: str = ""  # a checkpoint directory; empty: seeded random weights
    arch: str = "gpt2"
    kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as many as ``heads``
    head_dim: int = 0  # 0: d_model // heads
    ffn: int = 0  # MLP width; 0: 4 * d_model
    rope_theta: float = 10000.0
    rope_scaling: str = ""  # the checkpoint's rope scaling as JSON ("" = none); text keeps the config hashable
    attention_bias: bool = False
    mlp_bias: bool = False
    tied_head: bool = True  # LM head shares the token embedding
    qkv_bias: bool = False  # q/k/v projections have biases, the output projection none (Qwen2)
    sliding_window: int = 0  # a query sees only the last this many keys (Mistral, Qwen2); 0: all of them
    window_from_layer: int = 0  # the window applies to blocks from this index on (Qwen2's max_window_layers)
    family: str = ""  # the checkpoint's model_type (llama, qwen2, mistral, phi3) when it differs from arch
    rotary_dim: int = 0  # leading dims of each head that RoPE rotates (Phi-3's partial_rotary_factor); 0: all
    dtype: str = "float32"  # weights, KV cache and activations (one of DTYPES; "auto" is resolved before)
    quantize: str = ""  # "int8": a CPU stage's products with int8 weights (models.int8); "": in ``dtype``

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "heads", "layers", "max_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("kv_heads", "head_dim", "ffn", "sliding_window", "window_from_layer", "rotary_dim"):
            if getattr(self, name) < 0:
                raise ValueError(f"ModelConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {QUANTIZE}, got {self.quantize!r}")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch must be one of {ARCHITECTURES}, got {self.arch!r}")
        if self.head_dim == 0 and self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by heads ({self.heads})")
        if self.heads % self.num_kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.num_kv_heads})")
        wanted = ("silu",) if self.arch == "llama" else ACTIVATIONS
        if self.activation not in wanted:
            raise ValueError(f"activation of a {self.arch} model must be one of {wanted}, got {self.activation!r}")
        if self.arch == "gpt2" and (self.kv_heads not in (0, self.heads) or self.head_dim or self.ffn):
            raise ValueError("kv_heads, head_dim and ffn are Llama settings; a gpt2 model keeps their defaults")
        if self.arch == "gpt2" and (self.qkv_bias or self.sliding_window):
            raise ValueError("qkv_bias and sliding_window are Llama-family settings; a gpt2 model keeps their defaults")
        if self.rotary_dim % 2 or self.rotary_dim > self.dim_per_head:
            raise ValueError(f"rotary_dim must be even and <= head_dim ({self.dim_per_head}), got {self.rotary_dim}")
        if self.rope_type not in _LLAMA_ROPE:
            raise ValueError(f"rope scaling type must be one of {_LLAMA_ROPE}, got {self.rope_type!r}")

    @property
    def num_units(self) -> int:
        """Embedding + blocks + head."""
        return self.layers + 2

    @property
    def head_unit(self) -> int:
        return self.layers + 1

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.heads

    @property
    def rotary_width(self) -> int:
        """The leading dims of each head that RoPE rotates (the rest pass through unrotated)."""
        return self.rotary_dim or self.dim_per_head

    @property
    def mlp_width(self) -> int:
        return self.ffn or 4 * self.d_model

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def kv_bytes(self, positions: int) -> int:
        """K and V of ``positions`` positions in one block."""
        return 2 * positions * self.num_kv_heads * self.dim_per_head * self.dtype_bytes

    def window_of(self, block: int) -> int:
        """The sliding window of block ``block`` (0-based), 0 when it attends to every earlier key."""
        return self.sliding_window if block >= self.window_from_layer else 0

    @property
    def rope_params(self) -> dict[str, Any]:
        params: dict[str, Any] = json.loads(self.rope_scaling) if self.rope_scaling else {}
        return params

    @property
    def rope_type(self) -> str:
        return str(self.rope_params.get("rope_type", self.rope_params.get("type", "default")))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """The inverse of ``to_dict``; fields it lacks keep their defaults, values are coerced to the field's type."""
        casts: dict[str, Any] = {"int": int, "float": float, "str": str, "bool": bool}
        values = {f.name: casts[str(f.type)](data[f.name]) for f in fields(cls) if data.get(f.name) is not None}
        return cls(**values)


def resolve_dtype(requested: str, stored: str, on_gpu: bool, cpu_bf16: bool = False) -> str:
    """The dtype a run computes in: ``requested``, or for ``auto`` the checkpoint's own (``stored``) when every
    stage runs on a GPU; on CPUs a checkpoint stored in bfloat16 or float16 runs in bfloat16 where every CPU
    multiplies it natively (``cpu_bf16``: AVX512-BF16, AMX; vLLM's CPU build also runs float16 checkpoints in
    bfloat16), and everything else in float32 (without those instructions bfloat16 is emulated, and slower)."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"--dtype {requested!r} is not one of auto, {', '.join(DTYPES)}")
        return requested
    if on_gpu:
        return stored if stored in DTYPES else "float32"
    return "bfloat16" if cpu_bf16 and stored in ("bfloat16", "float16") else "float32"
