"""Which Hugging Face checkpoints the decoder runs, and the family of units each runs on: the one list.

A *family* is one set of unit classes with one forward each (``ModelConfig.arch``: its config reading, its
embedding, block and head, its weight loading, all in one module).  A *model type* is what a checkpoint's
``config.json`` names (``model_type``, else an entry of ``architectures``); several model types may run on
one family (Qwen2, Mistral and Phi-3 are Llama blocks with other settings).  Every list of known names (the
config's accepted ``arch``, the loaders' accepted model types, the error for an unknown one) is read from
here, so adding a family is one entry below plus its module.

Pure Python (no torch): ``models.config`` and ``placement`` import it; a family's module is imported only
when its units are built (``models.decoder.code``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

CONFIG_FILE = "config.json"


class ModelType(NamedTuple):
    """One ``model_type`` a checkpoint's config.json may name, and the family its units are."""

    model_type: str
    label: str  # how the user knows it, for messages
    classes: tuple[str, ...]  # config.json ``architectures`` entries that mean this model type
    family: str


# family (ModelConfig.arch) -> the module holding its config_from_dir, Embedding, Block, Head and load_units
FAMILIES: dict[str, str] = {
    "gpt2": "raycluster_cli.models.gpt2",
    "llama": "raycluster_cli.models.llama",
}
MODEL_TYPES = (
    ModelType("gpt2", "GPT-2", ("GPT2LMHeadModel", "GPT2Model"), "gpt2"),
    ModelType("llama", "Llama", ("LlamaForCausalLM",), "llama"),
    ModelType("qwen2", "Qwen2", ("Qwen2ForCausalLM",), "llama"),
    ModelType("mistral", "Mistral", ("MistralForCausalLM",), "llama"),
    ModelType("phi3", "Phi-3", ("Phi3ForCausalLM",), "llama"),
)
ARCHITECTURES = tuple(FAMILIES)
_BY_TYPE = {m.model_type: m for m in MODEL_TYPES}
_BY_CLASS = {name: m for m in MODEL_TYPES for name in m.classes}


def model_types(family: str) -> tuple[str, ...]:
    """The model types that run on ``family``."""
    return tuple(m.model_type for m in MODEL_TYPES if m.family == family)


def supported() -> str:
    """The known model types, for messages: ``GPT-2 (gpt2), Llama (llama) ... or Phi-3 (phi3)``."""
    names = [f"{m.label} ({m.model_type})" for m in MODEL_TYPES]
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


def read_config(directory: Path) -> dict[str, Any]:
    """The checkpoint's ``config.json`` as a dict (errors name the file)."""
    config_file = directory / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"--model-path {directory}: {CONFIG_FILE} not found (a Hugging Face checkpoint directory)")
    try:
        raw = json.loads(config_file.read_text())
    except ValueError as exc:
        raise ValueError(f"{config_file}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config_file}: not a JSON object")
    return raw


def model_type_of(raw: Mapping[str, Any]) -> ModelType | None:
    """The known model type a config names (``model_type``, else its first known ``architectures`` entry)."""
    known = _BY_TYPE.get(str(raw.get("model_type")))
    if known is None:
        known = next((_BY_CLASS[c] for c in raw.get("architectures") or [] if c in _BY_CLASS), None)
    return known


def checkpoint_family(path: str | Path) -> str:
    """The family of the Hugging Face checkpoint in ``path``, from its config.json (a config naming neither a
    model type nor architectures is GPT-2, as older GPT-2 exports are)."""
    raw = read_config(Path(path))
    known = model_type_of(raw)
    if known is not None:
        return known.family
    model_type, classes = raw.get("model_type"), raw.get("architectures") or []
    if model_type is None and not classes:
        return "gpt2"
    raise ValueError(
        f"{Path(path) / CONFIG_FILE}: model_type {model_type!r} (architectures {classes}) is not supported;"
        f" --model-path takes {supported()} checkpoints"
    )
