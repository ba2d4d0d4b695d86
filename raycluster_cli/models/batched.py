"""The bench's ``Stage`` run over a batch of independent sequences, each in its own KV cache slot: the service's.

Serving mixes rows at different positions in one forward (``rows.Rows``: each row's slot, start and length,
rows right-padded to the longest, as they travel between stages; on a CPU a stage packs their real tokens,
``rows.PackedRows``).  The units, their loading and their one forward are the bench stage's
own; this class holds the slots' caches and the products' measured forms (``models.matmuls``), keeps
only the logits that are sampled from, and samples them here when the step says how (``models.sampling``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import psutil
import torch
from torch import nn

from raycluster_cli.models.config import ModelConfig
from raycluster_cli.models.decoder import Stage
from raycluster_cli.models.int8 import Int8Matmuls
from raycluster_cli.models.kvcache import KV_BLOCK, BlockTable, PagedCache
from raycluster_cli.models.matmuls import Matmuls, measure
from raycluster_cli.models.rows import PackedRows, Rows, SlotCache
from raycluster_cli.models.sampling import sample_rows, sampled_rows, step_params

__all__ = ["BatchedStage", "Rows", "SlotCache"]


def linears(stage: Stage) -> tuple[list[nn.Linear], list[nn.Linear]]:
    """The stage's blocks' matrices and its head's (none without a head)."""
    blocks = [m for block in stage.blocks for m in block.modules() if isinstance(m, nn.Linear)]
    head = [m for m in stage.head.modules() if isinstance(m, nn.Linear)] if stage.head is not None else []
    return blocks, head


def measure_forms(stage: Stage, spare_bytes: int) -> tuple[Matmuls, Matmuls]:
    """The blocks' and the head's products in the forms measured cheapest on this CPU (``models.matmuls``),
    their packed copies within ``spare_bytes``."""
    blocks, head = linears(stage)
    block_mm = measure(blocks, spare_bytes=spare_bytes)
    head_mm = measure(head, spare_bytes=spare_bytes - block_mm.packed_bytes) if head else Matmuls()
    return block_mm, head_mm


class BatchedStage:
    """Units [start, end) of the model (built and loaded by the bench's ``Stage``) with ``slots`` KV slots, each
    slot's K/V taken in blocks of a shared pool as its sequence grows (``models.kvcache``) within ``kv_tokens`` positions in all
    (the scheduler admits by them; 0: ``slots`` x ``max_seq``, every slot full).

    ``forward(x, table)``: ``x`` is int64 token ids [B, T] on the first stage, hidden states [B, T, d]
    after it; ``table`` is int64 [3, B] (slot, start, length per row, rows right-padded to T).  The
    stage holding the head returns the logits of each row's last real token, [B, vocab]: only those
    are ever sampled from; a table of 4 rows whose fourth is set for some row (a prompt whose
    log-probabilities were asked for) gets every position's, [B, T, vocab].  A table that also carries every row's
    sampling settings (``models.sampling.TABLE_ROWS`` rows) and whose rows need no logits back gets each row's
    next token instead, int64 [B] (negative: its logits were not numbers): 8 bytes a row on the way back,
    not a vocabulary of floats.
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
        kv_tokens: int = 0,
        kv_block: int = KV_BLOCK,
    ) -> None:
        if slots < 1:
            raise ValueError(f"need at least one KV cache slot, got {slots}")
        self.stage = Stage(cfg, start, end, emit="logits", device=device)
        self.cfg = cfg
        self.slots = slots
        self.device = self.stage.device
        self.kv_tokens = kv_tokens or slots * cfg.max_seq
        self.table = BlockTable(slots, self.kv_tokens, self.device, kv_block)
        self.caches = [PagedCache(self.table, cfg, self.device) for _ in self.stage.blocks]
        # each slot's sequences begun here (rows at position 0): a release names the count it was sent at, so one
        # that arrives after a newer sequence began in the slot leaves that one's K/V alone
        self.begun = [0] * slots
        self._lock = threading.Lock()  # a release (the actor's thread) never lands inside a step (the links' thread)
        self._room = room_bytes or (lambda: int(psutil.virtual_memory().available))
        # the decode steps' products in the forms measured cheapest on this CPU (models.matmuls); F.linear on a GPU
        self.block_mm, self.head_mm = Matmuls(), Matmuls()
        if self.device.type == "cpu" and cfg.quantize == "int8":
            blocks, head = linears(self.stage)
            self.block_mm, self.head_mm = Int8Matmuls(blocks), Int8Matmuls(head)
        elif self.device.type == "cpu" and measure_matmuls:
            self.block_mm, self.head_mm = measure_forms(self.stage, self._spare_bytes())

    def _spare_bytes(self) -> int:
        """The room a packed copy of the matrices may take (``models.matmuls``): half of what this node's
        container can still take (``room_bytes``: the node runtime passes its cgroup's room; else what the OS
        says is available) once the KV cache's budget (``kv_tokens``, allocated as sequences grow) is counted."""
        room = self._room()
        kv = self.cfg.kv_bytes(self.kv_tokens) * len(self.caches)
        return max(0, room - kv) // 2

    @property
    def has_head(self) -> bool:
        return self.stage.has_head

    @property
    def held_tokens(self) -> int:
        """KV positions allocated now, over every slot (the same in every block)."""
        return self.table.held_tokens if self.caches else 0

    def release(self, ended: Iterable[tuple[int, int]]) -> None:
        """Sequences that ended or were preempted: (slot, how many sequences had begun in it then).  Their memory
        goes back now, unless a newer sequence has begun in the slot since (the K/V is then that one's)."""
        with self._lock:
            for slot, begun in ended:
                if 0 <= slot < self.slots and self.begun[slot] == begun:
                    self.table.release(slot)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(), self._lock:
            out = self._compute(x.to(self.device), table.to(self.device))
        return out if self.device.type == "cpu" else out.cpu()

    def _compute(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        every = table.shape[0] > 3 and bool(table[3].any())  # some row asks for every position's (prompt logprobs)
        rows = (PackedRows if self.device.type == "cpu" and not every else Rows).from_table(table, x.shape[1])
        if int(rows.slots.min()) < 0 or int(rows.slots.max()) >= self.slots:
            raise ValueError(f"slot out of range 0..{self.slots - 1}: {rows.slots.tolist()}")
        if rows.keys_len > self.cfg.max_seq:
            raise ValueError(f"sequence of {rows.keys_len} tokens exceeds max_seq={self.cfg.max_seq}")
        for slot, start, _ in rows.listed:
            self.begun[slot] += start == 0
        # the rows' sampling, when the step carries it and wants no logits back: only the rows it samples get logits
        params = step_params(table) if self.stage.head is not None and not every else None
        kept = sampled_rows(params)
        out = self._run_packed(x, rows, kept) if isinstance(rows, PackedRows) else self._run(x, rows, every, kept)
        if params is None:
            return out
        if kept is None:
            return sample_rows(out, params)
        tokens = torch.zeros(rows.slots.shape[0], dtype=torch.int64)  # a skipped row's token: 0, never read
        if kept.numel():
            tokens[kept] = sample_rows(out, params.select(kept))
        return tokens

    def _run_packed(self, x: torch.Tensor, rows: PackedRows, kept: torch.Tensor | None = None) -> torch.Tensor:
        """The step's real tokens packed (``PackedRows``) from the stage's entry to its exit: every product runs
        once over them, a mixed step's decode rows and prompt chunks together.  Padded, a step of 32 decodes and a
        64-token chunk computed 2 112 positions for 96 real ones; run apart, the decodes read every weight a second
        time.  Out as the padded path's: [B, T, d] to the next stage, or the rows' last logits [B, vocab] (only the
        ``kept`` rows', [K, vocab], when given: a prompt's chunk before its last needs none, and the head is the
        largest product of a real vocabulary's model: 151 936 x 896 read for every step that has any)."""
        stage = self.stage
        if self.caches:
            self.table.prepare(rows)
        h = stage.run_blocks(rows.pack(stage.enter(x, rows)), self.caches, rows, self.block_mm)
        if stage.head is None:
            return rows.unpack(h)
        return self._logits(h.index_select(0, rows.lasts), kept)

    def _run(self, x: torch.Tensor, rows: Rows, every: bool, kept: torch.Tensor | None = None) -> torch.Tensor:
        stage = self.stage
        if self.caches:
            self.table.prepare(rows)
        x = stage.run_blocks(stage.enter(x, rows), self.caches, rows, self.block_mm)
        if stage.head is None:
            return x
        if every:
            logits_every: torch.Tensor = stage.head(x, self.head_mm)
            return logits_every
        return self._logits(x[torch.arange(x.shape[0], device=x.device), rows.lengths - 1], kept)

    def _logits(self, last: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
        """The head over each row's last hidden state [B, d]: every row's logits, or only the ``kept`` rows' [K, vocab]
        (none computed when no row is kept)."""
        assert self.stage.head is not None
        if kept is not None:
            if not kept.numel():
                return last.new_zeros((0, 0))
            last = last.index_select(0, kept.to(last.device))
        logits: torch.Tensor = self.stage.head(last, self.head_mm)
        return logits
