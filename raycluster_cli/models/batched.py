"""The bench's ``Stage`` run over a batch of independent sequences, each in its own KV cache slot: the service's.

Serving mixes rows at different positions in one forward (``rows.Rows``: each row's slot, start and length,
rows right-padded to the longest).  The units, their loading and their one forward are the bench stage's
own; this class holds the slots' caches and the products' measured forms (``models.matmuls``), keeps
only the logits that are sampled from, and samples them here when the step says how (``models.sampling``).
"""

from __future__ import annotations

from collections.abc import Callable

import psutil
import torch
from torch import nn

from raycluster_cli.models.config import ModelConfig
from raycluster_cli.models.decoder import Stage
from raycluster_cli.models.matmuls import Matmuls, measure
from raycluster_cli.models.rows import Rows, SlotCache
from raycluster_cli.models.sampling import sample_rows, step_params

__all__ = ["BatchedStage", "Rows", "SlotCache"]


class BatchedStage:
    """Units [start, end) of the model (built and loaded by the bench's ``Stage``) with ``slots`` KV slots.

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
        x = stage.run_blocks(stage.enter(x, rows), self.caches, rows, self.block_mm)
        if stage.head is None:
            return x
        if table.shape[0] > 3 and bool(table[3].any()):  # some row asks for every position's (a prompt's logprobs)
            every: torch.Tensor = stage.head(x, stage.mm)
            return every
        last = x[torch.arange(x.shape[0], device=x.device), rows.lengths - 1]
        logits: torch.Tensor = stage.head(last, self.head_mm)
        params = step_params(table)
        return logits if params is None else sample_rows(logits, params)
