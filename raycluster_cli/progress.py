"""What library code reports while it works: a line of text, or how far a transfer to a host got.

The library calls the `Progress` callback it was given; render/base.py turns the calls into lines and bars.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args


@dataclass(frozen=True)
class TransferProgress:
    host: str
    sent: int  # bytes sent so far
    total: int  # bytes to send
    done: bool = False
    label: str = ""  # what to call the bar; default "image → <host>"


Phase = Literal["checking", "checked", "receiving", "starting", "waiting", "joined", "failed"]
PHASES: tuple[Phase, ...] = get_args(Phase)


@dataclass(frozen=True)
class HostPhase:
    """Where one host is in `up`: checking → (receiving the image) → starting → waiting → joined, or failed.

    `detail` says more (why it failed, what is being waited for); `joined` and `total` count the nodes
    alive so far out of the inventory's, as `up` knew them when it reported this.
    """

    host: str
    role: str
    phase: Phase
    detail: str = ""
    joined: int = 0
    total: int = 0


Event = str | TransferProgress | HostPhase
Progress = Callable[[Event], None]


def quiet(_: Event) -> None:
    pass
