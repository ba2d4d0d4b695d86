"""Where the operator's files are: the inventory a command line names, and the state folder.

Light on purpose (the standard library only): logins.py reads both before the CLI's imports.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_INVENTORY = "inventory.yaml"
INVENTORY_ENV = "RAYCLUSTER_INVENTORY"


def resolve_path(explicit: str | os.PathLike[str] | None) -> Path:
    """`-i/--inventory`, else `$RAYCLUSTER_INVENTORY`, else ./inventory.yaml."""
    if explicit:
        return Path(explicit)
    from_env = os.environ.get(INVENTORY_ENV)
    return Path(from_env) if from_env else Path(DEFAULT_INVENTORY)


def state_root() -> Path:
    """`$RAYCLUSTER_STATE_DIR`, else `$XDG_STATE_HOME/raycluster`, else ~/.local/state/raycluster."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(os.environ.get("RAYCLUSTER_STATE_DIR") or Path(base) / "raycluster")
