"""The `raycluster` command (and `python -m raycluster_cli`): logins start ahead (ahead.py), then the CLI's
imports, then the verb.

Kept apart from ahead.py so that nothing below the app imports it back: entry → ahead, entry → app → ahead.
"""

from __future__ import annotations

import gc
import sys

from raycluster_cli import defer_metadata
from raycluster_cli.cli.ahead import remember, start


def main() -> None:
    # The imports make some 40 000 objects that live as long as the process: with the collector off meanwhile
    # and those objects frozen (never traversed again, also not by the collection at exit), the start costs
    # ~15% less CPU. It is on again before the verb runs: a long verb's cycles are collected as always.
    gc.disable()
    undo = defer_metadata()
    try:
        start(sys.argv[1:])
        from raycluster_cli.cli.app import main as cli_main
    finally:
        undo()
        gc.freeze()
        gc.enable()
    try:
        cli_main()
    finally:
        remember()
