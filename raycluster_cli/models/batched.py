"""A bench ``Stage`` run over a batch of independent sequences, each in its own KV cache slot.

The bench's ``Stage`` feeds one micro-batch whose rows all sit at the same position (one ``start``).
Serving mixes rows at different positions in one forward: a decode step of a long conversation next
to the second prefill chunk of a new prompt.  So each row carries its own slot, start and length;
rows are right-padded to the longest, each query sees only keys up to its own position in its own
slot, and the padding is neither written to the cache nor read.  The weights (and their loading from
a checkpoint) are the bench stage's own modules; only the attention's bookkeeping differs, so the
bench's behaviour is untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import psutil
import torch
import torch.nn.functional as F
from torch import nn

from raycluster_cli.models import llama
from raycluster_cli.models.config import ModelConfig
from raycluster_cli.models.decoder import Block as GPT2Block
from raycluster_cli.models.decoder import Stage
from raycluster_cli.models.matmuls import Matmuls, measure


class SlotCache:
    """K/V of one block for every slot: [slots, kv_heads, max_seq, head_dim], allocated once."""

    def __init__(self, slots: int, cfg: ModelConfig, device: torch.device) -> None:
        shape = (slots, cfg.num_kv_heads, cfg.max_seq, cfg.dim_per_head)
        self.k = torch.zeros(shape, device=device, dtype=getattr(torch, cfg.dtype))
        self.v = torch.zeros(shape, device=device, dtype=getattr(torch, cfg.dtype))


@dataclass(frozen=True)
class Rows:
    """Where each row of a step lives: its cache slot, the position of its first token, its token count.
    What every block of a step needs from it is computed once per step (cached), not once per block."""

    slots: torch.Tensor  # int64 [B]
    starts: torch.Tensor  # int64 [B]
    lengths: torch.Tensor  # int64 [B]
    width: int  # T, the padded length

    @classmethod
    def from_table(cls, table: torch.Tensor, width: int) -> Rows:
        """From the [3, B] int64 table (slots, starts, lengths) the engine sends along with the tokens."""
        return cls(table[0], table[1], table[2], width)

    @cached_property
    def offsets(self) -> torch.Tensor:
        return torch.arange(self.width, device=self.slots.device)

    @cached_property
    def positions(self) -> torch.Tensor:
        """Absolute position of every (row, step) [B, T]; padding is clamped to the row's last real position."""
        last = self.starts + self.lengths - 1
        return torch.minimum(self.starts[:, None] + self.offsets[None, :], last[:, None])

    @cached_property
    def valid(self) -> torch.Tensor:
        return self.offsets[None, :] < self.lengths[:, None]

    @cached_property
    def keys_len(self) -> int:
        return int((self.starts + self.lengths).max())

    @cached_property
    def listed(self) -> list[tuple[int, int, int]]:
        """(slot, start, length) of every row as Python ints (one copy out of the table per step)."""
        return list(zip(self.slots.tolist(), self.starts.tolist(), self.lengths.tolist(), strict=True))

    @cached_property
    def _written(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        valid = self.valid
        return valid, self.slots[:, None].expand_as(valid)[valid], self.positions[valid]

    def mask(self, window: int = 0) -> torch.Tensor:
        """[B, 1, T, keys_len]: a query sees its own slot's keys up to its own position (never padding), and
        with a sliding ``window`` only the last ``window`` of them."""
        return llama.causal_mask(self.positions, self.keys_len, window, self.slots.device)[:, None]

    def write(self, cache: SlotCache, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the real (unpadded) steps' k, v [B, kv_heads, T, head_dim] at their slots and positions."""
        valid, slots, positions = self._written
        cache.k[slots, :, positions] = k.transpose(1, 2)[valid]
        cache.v[slots, :, positions] = v.transpose(1, 2)[valid]

    def read(self, cache: SlotCache) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.keys_len
        return cache.k[self.slots, :, :end], cache.v[self.slots, :, :end]

    def attend(self, q: torch.Tensor, cache: SlotCache, window: int = 0, gqa: bool = False) -> torch.Tensor:
        """Every row's queries [B, heads, T, head_dim] against its own slot's keys up to its own position:
        ``gathered`` on a GPU, ``by_row`` on a CPU (the same values)."""
        if q.device.type != "cpu":
            return self.gathered(q, cache, window, gqa)
        return self.by_row(q, cache, window, gqa)

    def gathered(self, q: torch.Tensor, cache: SlotCache, window: int = 0, gqa: bool = False) -> torch.Tensor:
        """The rows' keys and values gathered into one tensor, one masked attention."""
        keys, values = self.read(cache)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask(window), enable_gqa=gqa)

    def by_row(self, q: torch.Tensor, cache: SlotCache, window: int = 0, gqa: bool = False) -> torch.Tensor:
        """Row by row on views of the row's slot.  Gathering copies every row's keys and values in every block,
        which on a CPU costs more than the attention itself (a float32 block's 4 rows at ~130 positions: 0.33 ms
        of copy in 0.42 ms; 0.09 ms on views).  A decode row (one query, at the row's last position) sees every
        key up to it, so it needs no mask: its window, if any, is a narrower view.  Padding comes out as zeros."""
        out = []
        for b, (slot, start, length) in enumerate(self.listed):
            end = start + length
            first = max(0, end - window) if window and length == 1 else 0
            mask = None
            if length > 1:  # a prompt's chunk: each query sees the keys up to its own position
                mask = llama.causal_mask(self.positions[b : b + 1, :length], end, window, q.device)[:, None]
            keys, values = cache.k[slot : slot + 1, :, first:end], cache.v[slot : slot + 1, :, first:end]
            one = F.scaled_dot_product_attention(q[b : b + 1, :, :length], keys, values, attn_mask=mask, enable_gqa=gqa)
            out.append(F.pad(one, (0, 0, 0, self.width - length)) if length < self.width else one)
        return torch.cat(out) if len(out) > 1 else out[0]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _llama_block(block: llama.Block, x: torch.Tensor, cache: SlotCache, rows: Rows, mm: Matmuls) -> torch.Tensor:
    """``models.llama.Block.forward`` with per-row positions (its maths, its parameters; its products by
    ``mm``'s measured forms)."""
    batch, steps, _ = x.shape
    heads, kv_heads, width = block.heads, block.kv_heads, block.head_dim
    h = block.attn_norm(x)
    q = mm.apply(block.q, h).view(batch, steps, heads, width).transpose(1, 2)
    k = mm.apply(block.k, h).view(batch, steps, kv_heads, width).transpose(1, 2)
    v = mm.apply(block.v, h).view(batch, steps, kv_heads, width).transpose(1, 2)
    positions = rows.positions
    cos, sin = block.cos[positions][:, None], block.sin[positions][:, None]
    rows.write(cache, _rotate(k, cos, sin), v)
    att = rows.attend(_rotate(q, cos, sin), cache, block.window, gqa=kv_heads != heads)
    x = x + mm.apply(block.o, att.transpose(1, 2).reshape(batch, steps, heads * width))
    h = block.mlp_norm(x)
    out: torch.Tensor = x + mm.apply(block.down, F.silu(mm.apply(block.gate, h)) * mm.apply(block.up, h))
    return out


def _gpt2_block(block: GPT2Block, x: torch.Tensor, cache: SlotCache, rows: Rows, mm: Matmuls) -> torch.Tensor:
    """``models.decoder.Block.forward`` with per-row positions."""
    batch, steps, d = x.shape
    heads = block.heads
    qkv = mm.apply(block.qkv, block.ln1(x))
    q, k, v = (t.view(batch, steps, heads, d // heads).transpose(1, 2) for t in qkv.split(d, -1))
    rows.write(cache, k, v)
    att = rows.attend(q, cache)
    x = x + mm.apply(block.proj, att.transpose(1, 2).reshape(batch, steps, d))
    hidden = F.gelu(mm.apply(block.fc1, block.ln2(x)), approximate=block.gelu_approximate)
    out: torch.Tensor = x + mm.apply(block.fc2, hidden)
    return out


class BatchedStage:
    """Units [start, end) of the model (built and loaded by the bench's ``Stage``) with ``slots`` KV slots.

    ``forward(x, table)``: ``x`` is int64 token ids [B, T] on the first stage, hidden states [B, T, d]
    after it; ``table`` is int64 [3, B] (slot, start, length per row, rows right-padded to T).  The
    stage holding the head returns the logits of each row's last real token, [B, vocab]: only those
    are ever sampled from; a table of 4 rows whose fourth is set for some row (a prompt whose
    log-probabilities were asked for) gets every position's, [B, T, vocab].
    """

    def __init__(
        self,
        cfg: ModelConfig,
        start: int,
        end: int,
        slots: int,
        device: str | torch.device = "cpu",
        measure_matmuls: bool = True,
        room_bytes: Callable[[], int] | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"need at least one KV cache slot, got {slots}")
        self.stage = Stage(cfg, start, end, emit="logits", device=device)
        self.cfg = cfg
        self.slots = slots
        self.device = self.stage.device
        self.caches = [SlotCache(slots, cfg, self.device) for _ in self.stage.blocks]
        self._room = room_bytes or (lambda: int(psutil.virtual_memory().available))
        # the decode steps' products in the forms measured cheapest on this CPU (models.matmuls); F.linear on a GPU
        self.block_mm, self.head_mm = Matmuls(), Matmuls()
        if self.device.type == "cpu" and measure_matmuls:
            spare = self._spare_bytes()
            linears = [m for block in self.stage.blocks for m in block.modules() if isinstance(m, nn.Linear)]
            self.block_mm = measure(linears, spare_bytes=spare)
            if self.stage.head is not None:
                head = [m for m in self.stage.head.modules() if isinstance(m, nn.Linear)]
                self.head_mm = measure(head, spare_bytes=spare - self.block_mm.packed_bytes)

    def _spare_bytes(self) -> int:
        """The room a packed copy of the matrices may take (``models.matmuls``): half of what this node's
        container can still take (``room_bytes``: the node runtime passes its cgroup's room; else what the OS
        says is available) once the KV cache's pages (allocated, maybe not yet touched) are counted."""
        room = self._room()
        kv = sum(c.k.numel() * c.k.element_size() * 2 for c in self.caches)
        return max(0, room - kv) // 2

    @property
    def has_head(self) -> bool:
        return self.stage.has_head

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out = self._compute(x.to(self.device), table.to(self.device))
        return out if self.device.type == "cpu" else out.cpu()

    def _compute(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        rows = Rows.from_table(table, x.shape[1])
        if int(rows.slots.min()) < 0 or int(rows.slots.max()) >= self.slots:
            raise ValueError(f"slot out of range 0..{self.slots - 1}: {rows.slots.tolist()}")
        if rows.keys_len > self.cfg.max_seq:
            raise ValueError(f"sequence of {rows.keys_len} tokens exceeds max_seq={self.cfg.max_seq}")
        stage = self.stage
        x = self._embed(stage.embedding, x, rows) if stage.embedding is not None else x.to(stage.dtype)
        for block, cache in zip(stage.blocks, self.caches, strict=True):
            if isinstance(block, llama.Block):
                x = _llama_block(block, x, cache, rows, self.block_mm)
            elif isinstance(block, GPT2Block):
                x = _gpt2_block(block, x, cache, rows, self.block_mm)
            else:
                raise TypeError(f"no batched forward for {type(block).__name__}")
        if stage.head is None:
            return x
        if table.shape[0] > 3 and bool(table[3].any()):  # some row asks for every position's (a prompt's logprobs)
            every: torch.Tensor = stage.head(x)
            return every
        head: Any = stage.head  # a norm (llama's ``norm``, GPT-2's ``ln_f``) then ``lm_head``
        norm = head.norm if isinstance(head, llama.Head) else head.ln_f
        last = x[torch.arange(x.shape[0], device=x.device), rows.lengths - 1]
        logits: torch.Tensor = self.head_mm.apply(head.lm_head, norm(last))
        return logits

    def _embed(self, embedding: Any, ids: torch.Tensor, rows: Rows) -> torch.Tensor:
        out: torch.Tensor = embedding.tok(ids)
        if self.cfg.arch != "llama":  # learned positions (GPT-2)
            out = out + embedding.pos(rows.positions)
        return out
