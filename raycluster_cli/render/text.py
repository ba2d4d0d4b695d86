"""The one sanitiser of remote text on the operator's terminal.

Whatever a host or the service sends (error output, log lines, container states, the service's status fields,
events, model names, URLs) reaches the terminal through `terminal_safe`: no escape sequence in it moves the
cursor, clears the screen, sets the title or writes the clipboard (OSC 52). Where the text goes into rich markup,
`remote_text` also escapes the markup, so `[/x]` in a container state is shown, not parsed.
"""

from __future__ import annotations

import re

__all__ = ["remote_text", "terminal_safe"]

# Terminal control sequences in text from hosts (log lines, error output, command output): CSI (colours,
# cursor moves, screen clears), OSC (window titles, hyperlinks, clipboard writes), DCS/SOS/PM/APC strings,
# other two-byte ESC sequences, the 8-bit CSI, then every other C0/C1 control but tab and newline.
_CONTROL_SEQUENCES = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"
    r"|\x1b[PX^_][^\x1b]*(?:\x1b\\)?"
    r"|\x1b[ -/]*[0-~]"
    r"|\x9b[0-?]*[ -/]*[@-~]"
    r"|[\x00-\x08\x0b-\x1f\x7f-\x9f]"
)


def terminal_safe(text: str) -> str:
    """`text` without terminal control sequences: what a host sends never drives the operator's terminal."""
    return _CONTROL_SEQUENCES.sub("", text)


def remote_text(value: object) -> str:
    """A remote value (hosts' output, container states, the service's fields, events, model names, URLs) as
    text for rich markup: control sequences stripped, and markup escaped, so `[/x]` in a container state shows
    as written instead of crashing the view. Every renderer puts every remote value through this; text that
    does not go through markup (a `Text`, a raw write) goes through `terminal_safe` alone."""
    from rich.markup import escape

    return escape(terminal_safe(str(value)))
