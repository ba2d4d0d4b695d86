"""Where each row of a forward lives in the KV cache, and its attention: the bookkeeping every family's block
shares.

A forward runs a batch of independent sequences, each in its own KV cache slot.  Serving mixes rows at
different positions in one forward: a decode step of a long conversation next to the second prefill chunk of
a new prompt.  So each row carries its own slot, start and length (``Rows``); rows are right-padded to the
longest, each query sees only keys up to its own position in its own slot, and the padding is neither written
to the cache nor read.  The bench's micro-batch is the uniform case (``UniformRows``): every row at the same
position, row b in slot b of a cache of exactly its rows, so the cache is written and read as slices and one
attention serves all rows, as a plain KV-cached decoder does.  The service's steps on a CPU go packed
(``PackedRows``): the real tokens one after another, [N, d], no padding, so every product of a step runs once over
its N tokens.  A family's block calls ``rows.heads``, ``rows.rotary``, ``rows.write``, ``rows.attend`` and
``rows.merge`` and never knows which it got.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Self

import torch
import torch.nn.functional as F

from raycluster_cli.models.config import ModelConfig
from raycluster_cli.models.kvcache import PagedCache


def causal_mask(queries: torch.Tensor, end: int, window: int, device: torch.device) -> torch.Tensor:
    """[..., T, end]: the query at absolute position p sees keys p - window < k <= p (every k <= p with no window)."""
    keys = torch.arange(end, device=device)
    mask = keys <= queries[..., None]
    if window:
        mask &= keys > queries[..., None] - window
    return mask


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query per row, q [B, heads, 1, head_dim], against every one of its keys and values [B, kv_heads, L,
    head_dim] (a decode step: no mask), as two batched products in float32 on a CPU.

    torch's CPU attention kernel is built for many queries: for one query it costs several times the products
    it does (measured at Qwen2.5-0.5B's heads, 200 keys: 0.35 ms a row in bfloat16 against 0.08 here, a step of
    16 rows 5.0 ms against 0.27; float32 0.055 against 0.034).  Query head h reads key head h // (heads //
    kv_heads), as ``enable_gqa`` does; the scores and their softmax are float32, as the kernel accumulates."""
    rows, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    queries = q.float().reshape(rows * kv_heads, heads // kv_heads, dim)
    k = keys.float().reshape(rows * kv_heads, -1, dim)
    v = values.float().reshape(rows * kv_heads, -1, dim)
    probs = torch.softmax(torch.bmm(queries, k.transpose(1, 2)).mul_(dim**-0.5), dim=-1)
    return torch.bmm(probs, v).view(rows, heads, 1, dim).to(q.dtype)


class SlotCache:
    """K/V of one block for every slot: [slots, kv_heads, max_seq, head_dim], allocated once."""

    def __init__(self, slots: int, cfg: ModelConfig, device: torch.device) -> None:
        shape = (slots, cfg.num_kv_heads, cfg.max_seq, cfg.dim_per_head)
        self.k = torch.zeros(shape, device=device, dtype=getattr(torch, cfg.dtype))
        self.v = torch.zeros(shape, device=device, dtype=getattr(torch, cfg.dtype))

    def view(self, slot: int, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [first, end) of one slot, [1, kv_heads, end - first, head_dim], as views (no copy)."""
        return self.k[slot : slot + 1, :, first:end], self.v[slot : slot + 1, :, first:end]

    def write(self, rows: Rows, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the real (unpadded) steps' k, v [B, kv_heads, T, head_dim] at their slots and positions."""
        valid, slots, positions = rows.written
        self.k[slots, :, positions] = k.transpose(1, 2)[valid]
        self.v[slots, :, positions] = v.transpose(1, 2)[valid]

    def attend(self, rows: Rows, q: torch.Tensor, window: int = 0, gqa: bool = False) -> torch.Tensor:
        """``rows.gathered`` on a GPU, ``rows.by_row`` on a CPU (the same values)."""
        if q.device.type != "cpu":
            return rows.gathered(q, self, window, gqa)
        return rows.by_row(q, self, window, gqa)


KVCache = SlotCache | PagedCache  # reserved at max_seq for every slot (the bench's), or in blocks (the service's)


@dataclass(frozen=True)
class Rows:
    """Where each row of a step lives: its cache slot, the position of its first token, its token count.
    What every block of a step needs from it is computed once per step (cached), not once per block."""

    slots: torch.Tensor  # int64 [B]
    starts: torch.Tensor  # int64 [B]
    lengths: torch.Tensor  # int64 [B]
    width: int  # T, the padded length

    @classmethod
    def from_table(cls, table: torch.Tensor, width: int) -> Self:
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
    def real(self) -> torch.Tensor | None:
        """The real (row, step)s' places in the row-major [B * T]; None when no row is padded."""
        if all(length == self.width for _, _, length in self.listed):
            return None
        return self.valid.reshape(-1).nonzero()[:, 0]

    @cached_property
    def written(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        valid = self.valid
        return valid, self.slots[:, None].expand_as(valid)[valid], self.positions[valid]

    def heads(self, t: torch.Tensor, count: int) -> torch.Tensor:
        """A projection's output [B, T, count * head_dim] as attention's heads, [B, count, T, head_dim]."""
        return t.view(*t.shape[:-1], count, -1).transpose(1, 2)

    def merge(self, att: torch.Tensor) -> torch.Tensor:
        """Attention's output [B, heads, T, head_dim] as the next product's input, [B, T, heads * head_dim]."""
        return att.transpose(1, 2).reshape(att.shape[0], att.shape[2], -1)

    def rotary(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin at every (row, step), [B, 1, T, width], looked up once per step: every block of a
        stage holds the same tables (the model's), so the first block's lookup serves the others."""
        if "_rotary" not in self.__dict__:
            self.__dict__["_rotary"] = (cos[self.positions][:, None], sin[self.positions][:, None])
        cached: tuple[torch.Tensor, torch.Tensor] = self.__dict__["_rotary"]
        return cached

    def mask(self, window: int = 0) -> torch.Tensor:
        """[B, 1, T, keys_len]: a query sees its own slot's keys up to its own position (never padding), and
        with a sliding ``window`` only the last ``window`` of them."""
        return causal_mask(self.positions, self.keys_len, window, self.slots.device)[:, None]

    def write(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the real (unpadded) steps' k, v [B, kv_heads, T, head_dim] at their slots and positions."""
        cache.write(self, k, v)

    def attend(self, q: torch.Tensor, cache: KVCache, window: int = 0, gqa: bool = False) -> torch.Tensor:
        """Every row's queries [B, heads, T, head_dim] against its own slot's keys up to its own position, in the
        form the cache holds its keys for."""
        return cache.attend(self, q, window, gqa)

    def gathered(self, q: torch.Tensor, cache: SlotCache, window: int = 0, gqa: bool = False) -> torch.Tensor:
        """The rows' keys and values gathered into one tensor, one masked attention."""
        keys, values = cache.k[self.slots, :, : self.keys_len], cache.v[self.slots, :, : self.keys_len]
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
                mask = causal_mask(self.positions[b : b + 1, :length], end, window, q.device)[:, None]
            keys, values = cache.view(slot, first, end)
            if length == 1:
                one = decode_attention(q[b : b + 1, :, :1], keys, values)
            else:
                one = F.scaled_dot_product_attention(
                    q[b : b + 1, :, :length], keys, values, attn_mask=mask, enable_gqa=gqa
                )
            out.append(F.pad(one, (0, 0, 0, self.width - length)) if length < self.width else one)
        return torch.cat(out) if len(out) > 1 else out[0]


@dataclass(frozen=True)
class PackedRows(Rows):
    """The same rows with their real tokens packed, row after row, [N, ...] with no padding, from the stage's
    entry (``pack``) to its exit (``unpack``, or the head at ``lasts``): every product of a step runs once over
    its N real tokens.  Padded, a mixed step costs more: a decode row beside a 64-token prompt chunk computes 64
    positions of every product for its one, and run apart (two passes) the decode rows read every weight a second
    time.  Heads are [N, heads, head_dim]; the KV cache is paged (``PagedCache``), its attention per row
    (``PagedCache.attend_packed``)."""

    @cached_property
    def firsts(self) -> torch.Tensor:
        """int64 [B]: each row's first token's place among the N."""
        return torch.cumsum(self.lengths, 0) - self.lengths

    @cached_property
    def lasts(self) -> torch.Tensor:
        """int64 [B]: each row's last token's place among the N (what a head reads)."""
        return torch.cumsum(self.lengths, 0) - 1

    @cached_property
    def first_list(self) -> list[int]:
        return [int(f) for f in self.firsts.tolist()]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [N, ...]: the real tokens, row after row."""
        flat = x.reshape(-1, *x.shape[2:])
        return flat if self.real is None else flat.index_select(0, self.real)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, T, ...], the padding zeros (what the next stage of the pipeline is sent)."""
        batch = self.slots.shape[0]
        if self.real is None:
            return x.reshape(batch, self.width, *x.shape[1:])
        out = x.new_zeros((batch * self.width, *x.shape[1:]))
        out.index_copy_(0, self.real, x)
        return out.view(batch, self.width, *x.shape[1:])

    def heads(self, t: torch.Tensor, count: int) -> torch.Tensor:
        return t.view(t.shape[0], count, -1)

    def merge(self, att: torch.Tensor) -> torch.Tensor:
        return att.reshape(att.shape[0], -1)

    def rotary(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin at every real token, [N, 1, width], once per step."""
        if "_rotary" not in self.__dict__:
            at = self.pack(self.positions)
            self.__dict__["_rotary"] = (cos[at][:, None], sin[at][:, None])
        cached: tuple[torch.Tensor, torch.Tensor] = self.__dict__["_rotary"]
        return cached

    def write(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor) -> None:
        assert isinstance(cache, PagedCache), "packed rows need a paged cache"
        cache.write_packed(k, v)

    def attend(self, q: torch.Tensor, cache: KVCache, window: int = 0, gqa: bool = False) -> torch.Tensor:
        assert isinstance(cache, PagedCache), "packed rows need a paged cache"
        return cache.attend_packed(self, q, window, gqa)


@dataclass(frozen=True)
class UniformRows(Rows):
    """Every row at position ``start`` with ``width`` tokens, row b in slot b of a cache of exactly these rows:
    the bench's micro-batch.  The same values as ``Rows`` would give, with slices for gathers and one attention."""

    start: int = 0

    @classmethod
    def of(cls, batch: int, start: int, steps: int, device: torch.device) -> UniformRows:
        slots = torch.arange(batch, device=device)
        starts, lengths = torch.full_like(slots, start), torch.full_like(slots, steps)
        return cls(slots, starts, lengths, steps, start)

    @cached_property
    def positions(self) -> torch.Tensor:
        return (self.start + self.offsets)[None, :].expand(self.slots.shape[0], -1)

    @cached_property
    def keys_len(self) -> int:
        return self.start + self.width

    def write(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor) -> None:
        assert isinstance(cache, SlotCache), "a uniform micro-batch's cache holds exactly its rows"
        cache.k[:, :, self.start : self.keys_len] = k
        cache.v[:, :, self.start : self.keys_len] = v

    def attend(self, q: torch.Tensor, cache: KVCache, window: int = 0, gqa: bool = False) -> torch.Tensor:
        """One attention over views of the cache: a prompt's queries each see the keys up to their own position;
        a decode step (one query, at the last position) sees every key, or with a ``window`` a narrower view."""
        assert isinstance(cache, SlotCache), "a uniform micro-batch's cache holds exactly its rows"
        end, steps = self.keys_len, self.width
        first = max(0, end - window) if window and steps == 1 else 0
        mask = None
        if steps > 1:
            mask = causal_mask(torch.arange(self.start, end, device=q.device), end, window, q.device)
        keys, values = cache.k[:, :, first:end], cache.v[:, :, first:end]
        if steps == 1 and q.device.type == "cpu":
            return decode_attention(q, keys, values)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
