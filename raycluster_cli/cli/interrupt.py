"""Ctrl-C and SIGTERM for the CLI: stop host work at once, report what was done, exit 130 within seconds.

The first SIGINT/SIGTERM records which remote commands were running, sets the cancellation flag (no
queued host work starts, blocking reads and writes stop) and raises KeyboardInterrupt in the main thread,
which unwinds to the verb's error handling: one line on stderr, and under --json one document with
`ok: false`. Later signals are ignored (no traceback from a second Ctrl-C). If the main thread has not
finished within `LAST_RESORT_S`, a timer writes the document and ends the process. The CLI's `main` ends
an interrupted run with `os._exit`, so threads still waiting on a frozen host never hold the exit up.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from raycluster_cli import cancel

LAST_RESORT_S = 4.0


@dataclass
class Interruption:
    signal: str = ""
    running: list[dict[str, str]] = field(default_factory=list)  # remote commands running at the signal

    @property
    def happened(self) -> bool:
        return bool(self.signal)


@contextmanager
def handled(
    running: Callable[[], list[dict[str, str]]], last_resort: Callable[[Interruption], None]
) -> Iterator[Interruption]:
    """Install the SIGINT/SIGTERM handlers for one verb (main thread only); restore the old ones after."""
    state = Interruption()
    if threading.current_thread() is not threading.main_thread():
        yield state
        return

    def on_signal(number: int, _: FrameType | None) -> None:
        if state.happened:
            return  # already stopping: a second Ctrl-C must not raise inside the cleanup
        state.signal = signal.Signals(number).name
        # The last resort is armed first: the snapshot runs in the main thread wherever the signal caught
        # it, and must never be what keeps the process alive. It is taken before the cancellation, which
        # lets the host work end and forget its commands.
        timer = threading.Timer(LAST_RESORT_S, last_resort, args=(state,))
        timer.daemon = True
        timer.start()
        try:
            state.running = running()
        except Exception:  # a snapshot for the report only; never fail the handler
            state.running = []
        cancel.request()
        raise KeyboardInterrupt

    cancel.reset()
    previous = {number: signal.signal(number, on_signal) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield state
    finally:
        for number, handler in previous.items():
            # Once interrupted, further signals stay ignored until the process ends (no KeyboardInterrupt
            # from a second Ctrl-C while the report is written or the process exits).
            signal.signal(number, signal.SIG_IGN if state.happened else handler)


def report(state: Interruption, events: list[str]) -> dict[str, Any]:
    """The `interrupted` part of the JSON document: the signal, what was done, what was running."""
    return {"signal": state.signal or "SIGINT", "done": events, "running": state.running}


def hard_exit(code: int) -> None:
    """End the process now (after flushing): threads stuck on a frozen host must not delay the exit."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe: nothing more to say
            stream.flush()
    os._exit(code)
