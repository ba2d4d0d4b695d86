"""Garbage collection in the serving processes: the heap built at start-up frozen, full collections timed.

A full collection walks every object a process holds.  An ingress process (torch, transformers, Ray, FastAPI, the
tokenizer) holds ~280 000 of them at start-up, and walking them took 150–170 ms on the lab's CPU: a pause in every
stream the ingress serves, each time the old generation's collection comes round.  ``freeze_heap`` moves what is
alive once the process is set up into the permanent generation (``gc.freeze``, what Ray Serve's
``RAY_SERVE_FREEZE_GC_ON_STARTUP`` and vLLM do after start-up), so a full collection walks only what was made
since.  ``FullCollections`` times each full collection (``gc.callbacks``), for the service's status and a stage's
counters.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import deque
from typing import Any

KEEP = 256  # the last full collections' pauses kept for their median and largest


def freeze_heap() -> int:
    """Collect, then freeze every object alive now; the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class FullCollections:
    """Counts and times this process's collections of the oldest generation from its creation on."""

    def __init__(self, frozen_objects: int = 0) -> None:
        self.frozen_objects = frozen_objects  # what ``freeze_heap`` froze: ``gc.get_freeze_count()`` walks them all
        self.count = 0
        self.total_s = 0.0
        self.pauses: deque[float] = deque(maxlen=KEEP)
        self._began = 0.0
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
            return
        spent = time.perf_counter() - self._began
        self.count += 1
        self.total_s += spent
        self.pauses.append(spent)

    def summary(self) -> dict[str, Any]:
        """Full collections so far, their seconds in all, the median and largest of the last ``KEEP`` (ms), and
        the objects frozen at start-up (as counted then: counting them again walks the whole frozen heap, ~3 ms
        for 400 000 objects, in the status call of a serving process)."""
        pauses = list(self.pauses)
        return {
            "full_collections": self.count,
            "total_s": round(self.total_s, 4),
            "p50_ms": round(statistics.median(pauses) * 1e3, 2) if pauses else None,
            "max_ms": round(max(pauses) * 1e3, 2) if pauses else None,
            "frozen_objects": self.frozen_objects,
        }

    def close(self) -> None:
        if self._note in gc.callbacks:
            gc.callbacks.remove(self._note)
