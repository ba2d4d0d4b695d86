"""Checkpoint files through the ``safetensors`` package, so a stage reads just its own tensors.

``safe_open`` maps the file and parses its header; a tensor is copied out only when it is asked for,
so a stage that loads a few tensors of a large checkpoint touches only their pages.  What is here on
top of ``safetensors``: one error type naming the file, and sharded checkpoints (the index file that
maps tensor names to shards, which ``safetensors`` itself does not read).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open


class TensorFileError(ValueError):
    """The file is not a valid safetensors file, or lacks a tensor that was asked for."""


def _open(path: str | Path) -> Any:
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as exc:
        raise TensorFileError(f"{path}: not a valid safetensors file ({exc})") from None


def read_header(path: str | Path) -> dict[str, dict[str, Any]]:
    """Each tensor's ``{"dtype": "F32", "shape": [...]}`` (safetensors' dtype names), from the header only."""
    with _open(path) as f:
        table: dict[str, dict[str, Any]] = {}
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            view = f.get_slice(name)
            table[name] = {"dtype": view.get_dtype(), "shape": list(view.get_shape())}
        return table


def load_tensors(path: str | Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Read only the named tensors from ``path``; the rest of the file is never read into memory."""
    out: dict[str, torch.Tensor] = {}
    with _open(path) as f:
        present = set(f.keys())
        for name in names:
            if name not in present:
                raise TensorFileError(f"{path}: no tensor named {name!r}")
            try:
                out[name] = f.get_tensor(name)
            except SafetensorError as exc:  # e.g. a dtype this torch cannot hold
                raise TensorFileError(f"{path}: cannot read tensor {name!r} ({exc})") from None
    return out


WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_tensors(directory: str | Path) -> dict[str, Path]:
    """Tensor name -> the file holding it, for a checkpoint saved whole (``model.safetensors``) or in
    shards (``model.safetensors.index.json`` + its files, as Hugging Face saves models over ~5 GB)."""
    folder = Path(directory)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise TensorFileError(f"{index}: not a safetensors index ({exc!r})") from None
        return {str(name): folder / str(file) for name, file in weight_map.items()}
    single = folder / WEIGHTS_FILE
    if not single.is_file():
        raise TensorFileError(f"{folder}: neither {WEIGHTS_FILE} nor {INDEX_FILE} found")
    return dict.fromkeys(read_header(single), single)


def load_checkpoint_tensors(files: Mapping[str, Path], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Read only the named tensors, each from the file ``files`` (from ``checkpoint_tensors``) names."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        if name not in files:
            raise TensorFileError(f"checkpoint has no tensor named {name!r}")
        by_file.setdefault(files[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for path, wanted in by_file.items():
        out |= load_tensors(path, wanted)
    return out


_FLOAT_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def checkpoint_dtype(directory: str | Path) -> str:
    """The floating dtype holding most of the checkpoint's bytes (``float32``, ``bfloat16``, ...), from the
    headers only."""
    totals: dict[str, int] = {}
    for path in sorted(set(checkpoint_tensors(directory).values())):
        for entry in read_header(path).values():
            name = _FLOAT_NAMES.get(entry["dtype"])
            if name is not None:
                size = math.prod(entry["shape"]) * getattr(torch, name).itemsize
                totals[name] = totals.get(name, 0) + size
    return max(totals, key=lambda name: totals[name]) if totals else "float32"
