"""A minimal reader/writer for the safetensors format, so a stage can read just its own tensors.

The format (as the ``safetensors`` project specifies it): an 8-byte little-endian header length N, a
JSON header of N bytes ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__"?}``,
then the raw little-endian tensor bytes (offsets are relative to the end of the header).  Reading
one tensor is a seek and a read; nothing else in the file is touched.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 1024 * 1024


class TensorFileError(ValueError):
    """The file is not a valid safetensors file, or lacks a tensor that was asked for."""


def read_header(path: str | Path) -> tuple[dict[str, dict[str, Any]], int]:
    """The tensor table (without ``__metadata__``) and the byte offset where tensor data begins."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise TensorFileError(f"{path}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER:
            raise TensorFileError(f"{path}: header of {length} bytes is implausibly large")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise TensorFileError(f"{path}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + length


def load_tensors(path: str | Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Read only the named tensors from ``path`` (each one seek + read)."""
    if sys.byteorder != "little":  # pragma: no cover - every platform Ray runs on is little-endian
        raise TensorFileError("safetensors data is little-endian; this machine is not")
    header, data_start = read_header(path)
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        for name in names:
            entry = header.get(name)
            if entry is None:
                raise TensorFileError(f"{path}: no tensor named {name!r}")
            dtype = _DTYPES.get(str(entry.get("dtype")))
            if dtype is None:
                raise TensorFileError(f"{path}: tensor {name!r} has unsupported dtype {entry.get('dtype')!r}")
            begin, end = (int(v) for v in entry["data_offsets"])
            shape = [int(d) for d in entry["shape"]]
            if end - begin != math.prod(shape) * torch.empty((), dtype=dtype).element_size():
                raise TensorFileError(f"{path}: tensor {name!r} size does not match its shape {shape}")
            f.seek(data_start + begin)
            data = bytearray(f.read(end - begin))
            if len(data) != end - begin:
                raise TensorFileError(f"{path}: file ends inside tensor {name!r}")
            tensor = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
            out[name] = tensor.reshape(shape)
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
    return dict.fromkeys(read_header(single)[0], single)


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


_DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def checkpoint_dtype(directory: str | Path) -> str:
    """The floating dtype holding most of the checkpoint's bytes (``float32``, ``bfloat16``, ...), from the
    headers only."""
    totals: dict[str, int] = {}
    for path in sorted(set(checkpoint_tensors(directory).values())):
        for entry in read_header(path)[0].values():
            name = _DTYPE_NAMES.get(str(entry.get("dtype")))
            if name is not None:
                begin, end = (int(v) for v in entry["data_offsets"])
                totals[name] = totals.get(name, 0) + end - begin
    return max(totals, key=lambda name: totals[name]) if totals else "float32"
