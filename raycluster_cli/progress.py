"""What library code reports while it works: a line of text, or how far a transfer to a host got.

The library calls the `Progress` callback it was given; report.py turns the calls into lines and bars.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TransferProgress:
    host: str
    sent: int  # bytes sent so far
    total: int  # bytes to send
    done: bool = False
    label: str = ""  # what to call the bar; default "image → <host>"


Event = str | TransferProgress
Progress = Callable[[Event], None]


def quiet(_: Event) -> None:
    pass
