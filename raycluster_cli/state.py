"""This machine's state for each cluster and for the lab: where it lives and the cluster's Ray token.

Everything under one root: `$RAYCLUSTER_STATE_DIR`, else `$XDG_STATE_HOME/raycluster`, else
`~/.local/state/raycluster`; a folder per cluster (token, image archives) and `lab/` for the local lab.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from .inventory import Inventory


def state_root() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(os.environ.get("RAYCLUSTER_STATE_DIR") or Path(base) / "raycluster")


def state_dir(inventory: Inventory) -> Path:
    """This cluster's folder on the operator machine."""
    return state_root() / inventory.cluster


def token_file(inventory: Inventory) -> Path:
    return state_dir(inventory) / "auth-token"


def ensure_token(inventory: Inventory) -> bytes:
    """The cluster's Ray auth token, made once on the operator machine (mode 0600)."""
    path = token_file(inventory)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32))
    return path.read_bytes().strip()
