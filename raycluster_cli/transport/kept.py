"""Bounds on remote output held in memory: a command's stream keeps its last MAX_KEPT bytes (where a failure
is said), with a note of how much came before; a line handed on is at most MAX_LINE bytes (a longer one goes
in pieces). Each byte is looked at a bounded number of times, so time is linear in the output's size."""

from __future__ import annotations

from collections.abc import Callable

MAX_KEPT = 8 * 1024 * 1024  # bytes of one stream of one command kept in memory
MAX_LINE = 1024 * 1024  # bytes of one line handed on whole


class Tail:
    """The last `limit` bytes of a stream and the count of those before them (trimmed when twice the limit,
    so that trimming costs O(1) per byte)."""

    def __init__(self, limit: int = MAX_KEPT) -> None:
        self.limit = limit
        self.data = bytearray()
        self.cut = 0

    def __iadd__(self, chunk: bytes) -> Tail:
        self.data += chunk
        if len(self.data) > 2 * self.limit:
            over = len(self.data) - self.limit
            del self.data[:over]
            self.cut += over
        return self

    def text(self) -> str:
        over = max(0, len(self.data) - self.limit)
        cut = self.cut + over
        kept = bytes(self.data[over:]).decode(errors="replace")
        if not cut:
            return kept
        return f"[raycluster: the first {cut} bytes of this output were not kept (over {self.limit} bytes)]\n{kept}"


class LineSplitter:
    """Hands each whole line of a stream to `emit` (without its newline) as soon as it is whole; a line over
    MAX_LINE goes in pieces. Only new bytes are searched for newlines."""

    def __init__(self, emit: Callable[[bytes], None]) -> None:
        self.emit = emit
        self.partial = bytearray()

    def add(self, data: bytes) -> None:
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            self.partial += data[start:end]
            self._hand_on()
            start = end + 1
        self.partial += data[start:]
        while len(self.partial) > MAX_LINE:
            piece = bytes(self.partial[:MAX_LINE])
            del self.partial[:MAX_LINE]
            self.emit(piece)

    def finish(self) -> None:
        if self.partial:
            self._hand_on()

    def _hand_on(self) -> None:
        line = bytes(self.partial)
        self.partial.clear()
        self.emit(line)
