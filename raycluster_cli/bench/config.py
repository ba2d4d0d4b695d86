"""The shape of the benchmark's decoder: ``ModelConfig`` (shared by the model and the GPT-2 loader)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

ACTIVATIONS = ("gelu", "gelu_new")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder.  ``max_seq`` bounds prompt + generated tokens (position table, KV cache)."""

    vocab: int = 4096
    d_model: int = 256
    heads: int = 4
    layers: int = 12
    max_seq: int = 128
    seed: int = 0
    activation: str = "gelu"  # "gelu" (exact) or "gelu_new" (GPT-2's tanh approximation)
    ln_eps: float = 1e-5
    model_path: str = ""  # a GPT-2 checkpoint directory; empty: seeded random weights

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "heads", "layers", "max_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by heads ({self.heads})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")

    @property
    def num_units(self) -> int:
        """Embedding + blocks + head."""
        return self.layers + 2

    @property
    def head_unit(self) -> int:
        return self.layers + 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        ints = {k: int(data[k]) for k in ("vocab", "d_model", "heads", "layers", "max_seq", "seed")}
        return cls(
            **ints,
            activation=str(data.get("activation", "gelu")),
            ln_eps=float(data.get("ln_eps", 1e-5)),
            model_path=str(data.get("model_path", "") or ""),
        )
