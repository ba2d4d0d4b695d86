"""A small GPT-style decoder that can be cut into pipeline stages.

The model is addressed in *units*: unit 0 is the token + position embedding, units 1..L are the
transformer blocks and unit L+1 is the final LayerNorm + LM head.  The weights of every unit are
drawn from a generator seeded only by ``(seed, unit)``, so a stage that builds units [a, b) on
another machine gets bit-for-bit the same weights as the whole model built in one place.  Nothing
is downloaded; every node builds its own share.

With ``model_path`` set the same units are filled from a checkpoint in Hugging Face format instead: each
stage reads only the tensors of its own units.  ``cfg.arch`` picks the units' family (``registry``: GPT-2's
in ``gpt2.py``, also the random model's, or Llama's in ``llama.py``); every family runs through the same
``Stage``.  A unit has one forward, over rows at their own positions in their own KV slots (``rows``): the
bench's micro-batch is the uniform case of the service's mixed steps (``batched.BatchedStage``), so both run
the same maths.
"""

from __future__ import annotations

import hashlib
import importlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, Protocol, cast

import torch
from torch import nn

from raycluster_cli.models import registry
from raycluster_cli.models.config import ACTIVATIONS, ModelConfig, resolve_dtype
from raycluster_cli.models.matmuls import Matmuls
from raycluster_cli.models.rows import KVCache, Rows, SlotCache, UniformRows
from raycluster_cli.models.tensorfile import checkpoint_dtype

__all__ = [
    "ACTIVATIONS",
    "ModelConfig",
    "Stage",
    "config_from_checkpoint",
    "full_model_stage",
    "greedy_generate",
    "prefill_chunks",
    "resolve_dtype",
    "torch_dtype",
]

Emit = Literal["logits", "tokens"]

_LINEAR_STD = 0.02
_EMBED_STD = 0.5


def unit_seed(seed: int, unit: int) -> int:
    """A 63-bit seed that depends only on (seed, unit), stable across processes and platforms."""
    digest = hashlib.sha256(f"raycluster-bench:{seed}:{unit}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def _init_unit(module: nn.Module, seed: int, unit: int) -> None:
    """Overwrite every parameter of ``module`` from the (seed, unit) generator, in definition order."""
    gen = torch.Generator(device="cpu").manual_seed(unit_seed(seed, unit))
    for name, param in module.named_parameters():
        if name.startswith(("tok", "pos")):  # the embedding's tables
            param.normal_(0.0, _EMBED_STD, generator=gen)
        elif param.dim() >= 2:
            param.normal_(0.0, _LINEAR_STD, generator=gen)
        elif name.endswith("weight"):  # LayerNorm gain
            param.fill_(1.0)
        else:  # biases: small but non-zero so they matter
            param.normal_(0.0, _LINEAR_STD, generator=gen)


def checkpoint_architecture(path: str | Path) -> str:
    """The family (``ModelConfig.arch``) of the Hugging Face checkpoint in ``path`` (``registry``)."""
    return registry.checkpoint_family(path)


def config_from_checkpoint(
    path: str | Path,
    max_seq: int,
    seed: int = 0,
    dtype: str = "float32",
    on_gpu: bool = False,
    cpu_bf16: bool = False,
) -> ModelConfig:
    """The ModelConfig of the checkpoint in ``path``, whichever architecture its config.json names, computed in
    ``dtype`` (``auto``: from the checkpoint's own dtype and the devices, ``resolve_dtype``)."""
    cfg = code(checkpoint_architecture(path)).config_from_dir(path, max_seq, seed)
    stored = checkpoint_dtype(path) if dtype == "auto" else dtype
    return replace(cfg, dtype=resolve_dtype(dtype, stored, on_gpu, cpu_bf16))


def torch_dtype(cfg: ModelConfig) -> torch.dtype:
    dtype: torch.dtype = getattr(torch, cfg.dtype)
    return dtype


class Stage(nn.Module):
    """Units [start, end) of the model, with per-micro-batch KV caches kept inside.

    ``forward(x, cache_id, positions)``: ``x`` is int64 token ids [B, T] when the stage holds the
    embedding, otherwise hidden states [B, T, d_model] (cast to ``cfg.dtype``, which the weights, KV
    caches and outputs are held in).  ``positions`` is the absolute
    position of ``x[:, 0]``, i.e. how many tokens of this micro-batch are already cached: 0 means
    prefill (the cache for ``cache_id`` is (re)created), anything else is a decode step that must
    continue exactly where the cache ends.  A stage holding the head returns logits [B, T, vocab]
    (``emit="logits"``) or the greedy next token of each row, int64 [B] (``emit="tokens"``, which
    only runs the head on the last position).
    """

    def __init__(
        self, cfg: ModelConfig, start: int, end: int, emit: Emit = "tokens", device: str | torch.device = "cpu"
    ) -> None:
        super().__init__()
        if not 0 <= start < end <= cfg.num_units:
            raise ValueError(f"bad unit range [{start}, {end}) for a model with {cfg.num_units} units")
        if emit not in ("logits", "tokens"):
            raise ValueError(f"emit must be 'logits' or 'tokens', got {emit!r}")
        self.cfg = cfg
        self.start = start
        self.end = end
        self.emit: Emit = emit
        self.embedding: nn.Module | None = None
        self.head: nn.Module | None = None
        self.blocks = nn.ModuleList()
        family = code(cfg.arch)
        self.dtype = torch_dtype(cfg)
        modules: dict[int, nn.Module] = {}
        for unit in range(start, end):
            module: nn.Module
            if unit == 0:
                module = family.Embedding(cfg)
            elif unit == cfg.head_unit:
                module = family.Head(cfg)
            else:
                module = family.Block(cfg, unit - 1)
            module.to(self.dtype)  # unit by unit: at most one unit is ever held in float32 on the way
            if unit == 0:
                self.embedding = module
            elif unit == cfg.head_unit:
                self.head = module
            else:
                self.blocks.append(module)
            modules[unit] = module
        if cfg.model_path:
            family.load_units(cfg, modules)
        else:
            for unit, module in modules.items():
                _init_unit(module, cfg.seed, unit)
        self.device = torch.device(device)
        self.to(self.device)
        self.eval()
        self.requires_grad_(False)
        self._caches: dict[Any, tuple[int, list[SlotCache]]] = {}
        # the blocks' and the head's products: F.linear unless the node's measured forms are set (models.matmuls;
        # a BatchedStage measures its own, the bench's worker gives its counted runs the ones it calibrated with)
        self.mm = Matmuls()
        self.head_mm = Matmuls()

    @property
    def has_embedding(self) -> bool:
        return self.embedding is not None

    @property
    def has_head(self) -> bool:
        return self.head is not None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def forward(self, x: torch.Tensor, cache_id: Any, positions: int) -> torch.Tensor:
        with torch.inference_mode():
            return self._forward(x, cache_id, int(positions))

    def _forward(self, x: torch.Tensor, cache_id: Any, start: int) -> torch.Tensor:
        out = self._compute(x.to(self.device), cache_id, start)
        return out if self.device.type == "cpu" else out.cpu()

    def _compute(self, x: torch.Tensor, cache_id: Any, start: int) -> torch.Tensor:
        steps = x.shape[1]
        if start + steps > self.cfg.max_seq:
            raise ValueError(f"sequence of {start + steps} tokens exceeds max_seq={self.cfg.max_seq}")
        rows = UniformRows.of(x.shape[0], start, steps, self.device)  # row b in slot b of this micro-batch's cache
        x = self.enter(x, rows)
        if self.blocks:
            caches = self._cache_for(cache_id, x.shape[0], start)
            x = self.run_blocks(x, caches, rows, self.mm)
            self._caches[cache_id] = (start + steps, caches)
        if self.head is None:
            return x
        if self.emit == "logits":
            return self.head(x, self.head_mm)
        return self.head(x[:, -1:, :], self.head_mm)[:, 0, :].argmax(dim=-1)

    def enter(self, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        """What the first block takes: token ids [B, T] embedded (at the rows' positions) on the stage holding
        the embedding, hidden states [B, T, d] cast to the stage's dtype on the others."""
        if self.embedding is not None:
            if x.dtype != torch.long or x.dim() != 2:
                raise ValueError(f"first stage expects int64 token ids [B, T], got {x.dtype} {tuple(x.shape)}")
            out: torch.Tensor = self.embedding(x, rows)
            return out
        if x.dim() != 3 or x.shape[-1] != self.cfg.d_model:
            raise ValueError(f"stage expects hidden states [B, T, {self.cfg.d_model}], got {tuple(x.shape)}")
        return x.to(self.dtype)

    def run_blocks(self, x: torch.Tensor, caches: Sequence[KVCache], rows: Rows, mm: Matmuls) -> torch.Tensor:
        """Every block of the stage on ``x``, each with its own cache."""
        for block, cache in zip(self.blocks, caches, strict=True):
            x = block(x, cache, rows, mm)
        return x

    def _cache_for(self, cache_id: Any, batch: int, start: int) -> list[SlotCache]:
        if start == 0:
            return [SlotCache(batch, self.cfg, self.device) for _ in self.blocks]
        if cache_id not in self._caches:
            raise KeyError(f"no KV cache for micro-batch {cache_id!r}: decode before prefill?")
        length, caches = self._caches[cache_id]
        if length != start:
            raise ValueError(f"micro-batch {cache_id!r} has {length} cached tokens, got position {start}")
        if caches[0].k.shape[0] != batch:
            raise ValueError(f"micro-batch {cache_id!r} batch size changed: {caches[0].k.shape[0]} -> {batch}")
        return caches

    def release(self, cache_id: Any) -> bool:
        """Free the KV cache of a finished micro-batch; False if there was none."""
        return self._caches.pop(cache_id, None) is not None

    def cached_ids(self) -> list[Any]:
        return list(self._caches)

    def weight_bytes(self) -> int:
        """Bytes of this stage's parameters and buffers, at its dtype."""
        tensors = [*self.parameters(), *self.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def cache_bytes(self) -> int:
        """Bytes of the KV caches held now (every micro-batch in flight)."""
        return sum(c.k.nbytes + c.v.nbytes for _, caches in self._caches.values() for c in caches)


def full_model_stage(cfg: ModelConfig, emit: Emit = "tokens") -> Stage:
    """One stage holding every unit: the unsharded reference model."""
    return Stage(cfg, 0, cfg.num_units, emit=emit)


def prefill_chunks(prompt_len: int, chunk: int = 0) -> list[tuple[int, int]]:
    """The [start, end) token ranges a prompt is fed in: one piece, or pieces of ``chunk`` tokens.

    Chunked prefill (as in Sarathi-Serve and vLLM) makes a prefill step cost about as much as a few
    decode steps, so one long prefill does not leave the stages after it waiting.
    """
    if prompt_len < 1:
        raise ValueError("prompt_len must be >= 1")
    if chunk < 0:
        raise ValueError(f"prefill chunk must be >= 0 tokens (0: whole prompt), got {chunk}")
    size = chunk or prompt_len
    return [(a, min(a + size, prompt_len)) for a in range(0, prompt_len, size)]


def greedy_generate(
    stages: list[Stage],
    prompts: torch.Tensor,
    max_new_tokens: int,
    cache_id: Any = "greedy",
    prefill_chunk: int = 0,
) -> torch.Tensor:
    """Greedy decoding through ``stages`` in order (the last must emit tokens); returns int64 [B, N].

    ``prefill_chunk`` feeds the prompt in pieces of that many tokens (0: all at once); only the last
    piece's token is kept, as in the pipeline.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    out: list[torch.Tensor] = []
    try:
        x: torch.Tensor = prompts
        for a, b in prefill_chunks(prompts.shape[1], prefill_chunk):
            x = prompts[:, a:b]
            for stage in stages:
                x = stage(x, cache_id, a)
        position = prompts.shape[1]
        out.append(x)
        for _ in range(max_new_tokens - 1):
            x = x[:, None]
            for stage in stages:
                x = stage(x, cache_id, position)
            position += 1
            out.append(x)
    finally:
        for stage in stages:
            stage.release(cache_id)
    return torch.stack(out, dim=1)


def seconds_per_pass(
    stage: Any, first: Any, prompt_len: int, decode_steps: int, min_sample_s: float, key: str, prefill_chunk: int = 0
) -> tuple[float, float]:
    """Wall and CPU seconds (this process's, every thread) of one micro-batch (the prompt in ``prefill_chunk``
    pieces, then ``decode_steps``) through ``stage``: passes repeated until ``min_sample_s`` has elapsed (a CPU
    quota's stalls show only over several scheduler periods), their means; the cache under ``key`` released after."""
    passes, began, cpu_began = 0, time.perf_counter(), time.process_time()
    while True:
        for a, b in prefill_chunks(prompt_len, prefill_chunk):
            stage(first[:, a:b], key, a)
        for i in range(decode_steps):
            stage(first[:, :1], key, prompt_len + i)
        passes += 1
        elapsed = time.perf_counter() - began
        if elapsed >= min_sample_s:
            break
    cpu = time.process_time() - cpu_began
    stage.release(key)
    return elapsed / passes, cpu / passes


class FamilyCode(Protocol):
    """What a family's module provides (``models.gpt2``, ``models.llama``)."""

    Embedding: Callable[[ModelConfig], nn.Module]  # forward(ids [B, T], rows) -> hidden [B, T, d]
    Block: Callable[[ModelConfig, int], nn.Module]  # (config, block index from 0); forward(x, cache, rows, mm)
    Head: Callable[[ModelConfig], nn.Module]  # forward(x, mm) -> logits

    def config_from_dir(self, path: str | Path, max_seq: int, seed: int = 0) -> ModelConfig: ...

    def load_units(self, cfg: ModelConfig, modules: Mapping[int, nn.Module]) -> None: ...


def code(arch: str) -> FamilyCode:
    """The module of family ``arch`` (imported now: it needs torch)."""
    if arch not in registry.FAMILIES:
        raise ValueError(f"arch must be one of {registry.ARCHITECTURES}, got {arch!r}")
    return cast(FamilyCode, importlib.import_module(registry.FAMILIES[arch]))
