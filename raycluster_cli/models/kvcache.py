"""K/V storage by blocks of positions, taken as sequences grow and given back when they end (paged).

A slot reserved at ``max_seq`` positions holds its memory whatever the request's length: Llama-3-8B at 8k
context reserves 2 GiB a slot, so a node's memory caps the sequences at once, not their tokens.  Here every block
(layer) of a stage has one pool of K and one of V, [kv_heads, positions, head_dim], cut into blocks of ``KV_BLOCK``
positions; a ``BlockTable`` shared by the stage's layers says which pool blocks each slot's sequence holds (the
same in every layer), hands out free ones as a sequence passes its last, and takes them back when it ends.  The
pool is allocated once for the stage's token budget (untouched pages cost no memory until a sequence writes them)
and grows only if more blocks are asked for than it has (a release that arrives after the next sequence began).
The scheduler (``serve.scheduler``) admits sequences by the same blocks, so the blocks in use stay within the budget.

One pool per layer is what lets a decode step read every row's keys with one gather and attend to all of them with
two batched products (``PagedCache.attend``), where per-slot buffers cost each row its own handful of small calls
per layer (16 rows at Qwen2.5-0.5B's heads: 0.26 ms a layer against 0.72 on the lab's CPU, a tenth of a step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from raycluster_cli.models.config import ModelConfig

if TYPE_CHECKING:
    from raycluster_cli.models.rows import PackedRows, Rows

KV_BLOCK = 64  # positions a sequence's K/V grows by: the scheduler's block (serve.scheduler.Limits.kv_block)


@dataclass
class StepIndex:
    """Where one forward's rows read and write in the pools, worked out once for all of the stage's layers."""

    write: torch.Tensor  # int64 [n]: the pool position of every real (row, step), rows in order
    real: torch.Tensor | None  # int64 [n]: those (row, step)s' places in the row-major [B * T], None: every one
    decode: torch.Tensor  # int64 [d]: the rows of one token (a decode step)
    reads: torch.Tensor  # int64 [d * L]: each decode row's pool positions 0..L-1 (padded with position 0)
    ends: torch.Tensor  # int64 [d]: each decode row's key count
    width: int  # L, the longest decode row's keys
    chunks: dict[int, torch.Tensor] = field(default_factory=dict)  # row of several tokens -> its pool positions 0..
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> float32 [d, L] (0 or -inf)
    gathered: torch.Tensor | None = None  # a GPU's: every row's pool positions, padded to the step's longest

    def mask(self, window: int) -> torch.Tensor:
        """A decode row sees its own keys (not the padding up to the longest), within ``window`` when set."""
        if window not in self.masks:
            keys = torch.arange(self.width, device=self.ends.device)[None, :]
            seen = keys < self.ends[:, None]
            if window:
                seen &= keys >= self.ends[:, None] - window
            zero = torch.zeros((), device=self.ends.device)
            self.masks[window] = torch.where(seen, zero, torch.tensor(float("-inf"), device=self.ends.device))
        return self.masks[window]


class BlockTable:
    """Which pool blocks each slot's sequence holds, shared by every layer of a stage."""

    def __init__(self, slots: int, capacity_tokens: int, device: torch.device, block: int = KV_BLOCK) -> None:
        if block < 1:
            raise ValueError(f"a KV block must hold at least one position, got {block}")
        self.block, self.device = block, device
        self.count = max(1, -(-capacity_tokens // block))  # blocks the pools have room for
        self.free = list(range(self.count - 1, -1, -1))  # popped from the end: lowest first
        self.held: list[list[int]] = [[] for _ in range(slots)]
        self.step: StepIndex | None = None

    @property
    def held_tokens(self) -> int:
        return sum(len(blocks) for blocks in self.held) * self.block

    def capacity(self, slot: int) -> int:
        return len(self.held[slot]) * self.block

    def release(self, slot: int) -> None:
        self.free.extend(reversed(self.held[slot]))
        self.held[slot] = []

    def _reserve(self, slot: int, end: int) -> None:
        blocks = self.held[slot]
        while len(blocks) * self.block < end:
            if not self.free:  # more asked for than the budget (a late release): the pools grow by a quarter
                more = max(1, self.count // 4)
                self.free = list(range(self.count + more - 1, self.count - 1, -1))
                self.count += more
            blocks.append(self.free.pop())

    def positions(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Pool positions of the slot's sequence positions [start, end)."""
        where = torch.arange(start, end)
        blocks = torch.tensor(self.held[slot], dtype=torch.long)
        return blocks[where // self.block] * self.block + where % self.block

    def prepare(self, rows: Rows) -> StepIndex:
        """Blocks for every row's new positions (a row at position 0 starts a new sequence: what an earlier one left
        in its slot is given back first), and the step's indices (``self.step``, read by every layer's cache)."""
        listed = rows.listed
        for slot, start, length in listed:
            if start == 0:
                self.release(slot)
            self._reserve(slot, start + length)
        write = torch.cat([self.positions(slot, start, start + length) for slot, start, length in listed])
        real = rows.real
        decode = [b for b, (_, _, length) in enumerate(listed) if length == 1]
        ends = [listed[b][1] + 1 for b in decode]
        width = max(ends, default=0)
        reads = [self.positions(listed[b][0], 0, end) for b, end in zip(decode, ends, strict=True)]
        reads = [F.pad(r, (0, width - r.numel())) for r in reads]
        self.step = StepIndex(
            write=write.to(self.device),
            real=None if real is None else real.to(self.device),
            decode=torch.tensor(decode, dtype=torch.long, device=self.device),
            reads=(torch.cat(reads) if reads else torch.zeros(0, dtype=torch.long)).to(self.device),
            ends=torch.tensor(ends, dtype=torch.long, device=self.device),
            width=width,
            chunks={
                b: self.positions(slot, 0, start + length).to(self.device)
                for b, (slot, start, length) in enumerate(listed)
                if length > 1
            },
        )
        return self.step


class PagedCache:
    """K and V of one layer for every slot: pools [kv_heads, positions, head_dim] in blocks (``BlockTable``)."""

    def __init__(self, table: BlockTable, cfg: ModelConfig, device: torch.device) -> None:
        self.table = table
        self._shape = (cfg.num_kv_heads, cfg.dim_per_head)
        self._dtype, self._device = getattr(torch, cfg.dtype), device
        self.k, self.v = self._alloc(table.count * table.block), self._alloc(table.count * table.block)

    def _alloc(self, positions: int) -> torch.Tensor:
        heads, dim = self._shape
        return torch.empty((heads, positions, dim), dtype=self._dtype, device=self._device)

    @property
    def held_tokens(self) -> int:
        return self.table.held_tokens

    @property
    def held_bytes(self) -> int:
        heads, dim = self._shape
        return self.table.held_tokens * heads * dim * self.k.element_size() * 2

    def _fit(self) -> None:
        """The pools grown to the table's blocks (rare: only when more were asked for than the budget)."""
        want = self.table.count * self.table.block
        have = self.k.shape[1]
        if want > have:
            for name in ("k", "v"):
                grown = self._alloc(want)
                grown[:, :have] = getattr(self, name)
                setattr(self, name, grown)

    def write(self, rows: Rows, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the real steps' k, v [B, kv_heads, T, head_dim] at their pool positions (``BlockTable.prepare``)."""
        step = self.table.step
        assert step is not None, "BlockTable.prepare runs before a step's layers"
        self._fit()
        for pool, new in ((self.k, k), (self.v, v)):
            flat = new.transpose(0, 1).reshape(new.shape[1], -1, new.shape[3])  # [kv_heads, B * T, head_dim]
            if step.real is not None:
                flat = flat.index_select(1, step.real)
            pool.index_copy_(1, step.write, flat.to(pool.dtype))

    def write_packed(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a packed step's k, v [N, kv_heads, head_dim] (``rows.PackedRows``: its real tokens, row after row,
        the order of ``StepIndex.write``)."""
        step = self.table.step
        assert step is not None, "BlockTable.prepare runs before a step's layers"
        self._fit()
        for pool, new in ((self.k, k), (self.v, v)):
            pool.index_copy_(1, step.write, new.transpose(0, 1).to(pool.dtype))

    def attend_packed(self, rows: PackedRows, q: torch.Tensor, window: int = 0, gqa: bool = False) -> torch.Tensor:
        """A packed step's queries [N, heads, head_dim] against each one's own keys up to its own position: the
        decode rows' together (``decode``), each prompt chunk on its own keys; out [N, heads, head_dim]."""
        step = self.table.step
        assert step is not None, "BlockTable.prepare runs before a step's layers"
        if step.decode.numel() == q.shape[0]:  # every row one token: the N tokens are the rows, in order
            return self.decode(q[:, :, None], step, window)[:, :, 0]
        out = torch.empty_like(q)
        if step.decode.numel():
            tokens = rows.firsts[step.decode]
            out[tokens] = self.decode(q[tokens][:, :, None], step, window)[:, :, 0]
        masks = rows.mask(window)
        for b, where in step.chunks.items():
            first, length, end = rows.first_list[b], rows.listed[b][2], where.numel()
            keys, values = self._select(where)
            mask = masks[b : b + 1, :, :length, :end]
            one = F.scaled_dot_product_attention(
                q[first : first + length].transpose(0, 1)[None], keys, values, attn_mask=mask, enable_gqa=gqa
            )
            out[first : first + length] = one[0].transpose(0, 1)
        return out

    def keys(self, slot: int, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [first, end) of one slot, [1, kv_heads, end - first, head_dim] (gathered: a copy)."""
        return self._select(self.table.positions(slot, first, end).to(self.k.device))

    def _select(self, where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.index_select(1, where)[None], self.v.index_select(1, where)[None]

    def gather(self, rows: Rows, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's positions [0, end) in one tensor [B, kv_heads, end, head_dim]; a row's positions past its
        own end are another position's values (its mask hides them).  The index is the step's, worked out by the
        first layer that asks."""
        step = self.table.step
        assert step is not None, "BlockTable.prepare runs before a step's layers"
        if step.gathered is None:
            where = [self.table.positions(slot, 0, start + length) for slot, start, length in rows.listed]
            step.gathered = torch.cat([F.pad(w, (0, end - w.numel())) for w in where]).to(self.k.device)
        heads, dim = self._shape
        batch = len(rows.listed)
        return tuple(  # type: ignore[return-value]
            pool.index_select(1, step.gathered).view(heads, batch, end, dim).transpose(0, 1)
            for pool in (self.k, self.v)
        )

    def attend(self, rows: Rows, q: torch.Tensor, window: int = 0, gqa: bool = False) -> torch.Tensor:
        """Every row's queries [B, heads, T, head_dim] against its own keys up to its own position.  On a GPU one
        masked attention over the gathered rows; on a CPU the decode rows (one query each) together in two batched
        products (``decode``), a prompt's chunk on its own keys (``keys``), the padding zeros."""
        if q.device.type != "cpu":
            keys, values = self.gather(rows, rows.keys_len)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=rows.mask(window), enable_gqa=gqa)
        step = self.table.step
        assert step is not None, "BlockTable.prepare runs before a step's layers"
        if step.decode.numel() == q.shape[0]:
            return self.decode(q, step, window)
        out = q.new_zeros(q.shape)
        if step.decode.numel():
            out[step.decode, :, :1] = self.decode(q[step.decode, :, :1], step, window)
        masks = rows.mask(window)
        for b, where in step.chunks.items():
            length, end = rows.listed[b][2], where.numel()
            keys, values = self._select(where)
            mask = masks[b : b + 1, :, :length, :end]
            out[b : b + 1, :, :length] = F.scaled_dot_product_attention(
                q[b : b + 1, :, :length], keys, values, attn_mask=mask, enable_gqa=gqa
            )
        return out

    def decode(self, q: torch.Tensor, step: StepIndex, window: int) -> torch.Tensor:
        """One query per decode row, q [d, heads, 1, head_dim], against its keys: query head h reads key head
        h // (heads // kv_heads).  The scores and their softmax in float32 (as torch's attention kernels
        accumulate), the probabilities times the values in the model's dtype (bfloat16 where it is: as those
        kernels do for reduced types; torch's CPU attention kernel is built for many queries, and for one it
        costs several times these products)."""
        rows, heads, _, dim = q.shape
        kv_heads, width = self._shape[0], step.width
        group = heads // kv_heads
        work = q.dtype if q.dtype in (torch.float32, torch.bfloat16) else torch.float32
        keys = self.k.index_select(1, step.reads).view(kv_heads * rows, width, dim).float()
        values = self.v.index_select(1, step.reads).view(kv_heads * rows, width, dim).to(work)
        queries = q.reshape(rows, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads * rows, group, dim)
        scores = torch.bmm(queries.float(), keys.transpose(1, 2)).mul_(dim**-0.5)
        scores = scores.view(kv_heads, rows, group, width).add_(step.mask(window)[None, :, None, :])
        probs = torch.softmax(scores, dim=-1).view(kv_heads * rows, group, width).to(work)
        out = torch.bmm(probs, values).view(kv_heads, rows, group, dim).transpose(0, 1)
        return out.reshape(rows, heads, 1, dim).to(q.dtype)
