"""K/V storage that grows with each sequence instead of being reserved at the full context for every slot.

A slot reserved at ``max_seq`` positions holds its memory whatever the request's length: Llama-3-8B at 8k
context reserves 2 GiB a slot, so a node's memory caps the sequences at once, not their tokens.  Here each
slot of a block owns one contiguous buffer [kv_heads, capacity, head_dim], grown ``KV_BLOCK`` positions at a
time (what it holds copied into the larger one) when a write would pass its capacity, and emptied when its
sequence ends.  Contiguous per slot because a CPU's attention reads each row's keys as views of its own slot
(``rows.Rows.by_row``: cheaper than gathering them); a GPU's gathered attention pads each slot's view to the
step's longest (``gather``).  The scheduler (``serve.scheduler``) admits sequences by the same blocks, so the
buffers together stay within the stage's token budget.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raycluster_cli.models.config import ModelConfig

KV_BLOCK = 64  # positions a slot's buffer grows by: the scheduler's block (serve.scheduler.Limits.kv_block)


class GrowingCache:
    """K/V of one block for every slot, each slot's its own buffer of a whole number of blocks (0 when idle)."""

    def __init__(self, slots: int, cfg: ModelConfig, device: torch.device, block: int = KV_BLOCK) -> None:
        if block < 1:
            raise ValueError(f"a KV block must hold at least one position, got {block}")
        self.block, self.max_seq = block, cfg.max_seq
        self._shape = (cfg.num_kv_heads, cfg.dim_per_head)
        self._dtype, self._device = getattr(torch, cfg.dtype), device
        self.k = [self._alloc(0) for _ in range(slots)]
        self.v = [self._alloc(0) for _ in range(slots)]

    def _alloc(self, capacity: int) -> torch.Tensor:
        heads, dim = self._shape
        return torch.empty((heads, capacity, dim), dtype=self._dtype, device=self._device)

    def capacity(self, slot: int) -> int:
        return int(self.k[slot].shape[1])

    @property
    def held_tokens(self) -> int:
        """Positions allocated over every slot (a whole number of blocks each)."""
        return sum(int(k.shape[1]) for k in self.k)

    @property
    def held_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k in self.k)

    def reserve(self, slot: int, end: int) -> None:
        """Room for positions [0, end) in ``slot``: one buffer a whole number of blocks larger, what it held
        copied in, when ``end`` passes its capacity."""
        have = self.capacity(slot)
        if end <= have:
            return
        size = min(max(self.max_seq, end), -(-end // self.block) * self.block)
        for store in (self.k, self.v):
            grown = self._alloc(size)
            grown[:, :have] = store[slot]
            store[slot] = grown

    def release(self, slot: int) -> None:
        """The slot's sequence ended (or a new one starts in it): its memory goes back."""
        self.k[slot] = self._alloc(0)
        self.v[slot] = self._alloc(0)

    def write(self, listed: list[tuple[int, int, int]], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store each row's real steps of k, v [B, kv_heads, T, head_dim] at its slot and positions.  A row at
        position 0 starts a new sequence in its slot: whatever an earlier one left there is dropped first."""
        for b, (slot, start, length) in enumerate(listed):
            if start == 0:
                self.release(slot)
            end = start + length
            self.reserve(slot, end)
            self.k[slot][:, start:end] = k[b, :, :length]
            self.v[slot][:, start:end] = v[b, :, :length]

    def view(self, slot: int, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [first, end) of one slot, [1, kv_heads, end - first, head_dim], as views (no copy)."""
        return self.k[slot][None, :, first:end], self.v[slot][None, :, first:end]

    def gather(self, listed: list[tuple[int, int, int]], end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's positions [0, end) in one tensor [B, kv_heads, end, head_dim]; a row's positions past
        its own end are zeros (its mask hides them)."""
        keys, values = [], []
        for slot, start, length in listed:
            mine = start + length
            keys.append(F.pad(self.k[slot][:, :mine], (0, 0, 0, end - mine)))
            values.append(F.pad(self.v[slot][:, :mine], (0, 0, 0, end - mine)))
        return torch.stack(keys), torch.stack(values)
