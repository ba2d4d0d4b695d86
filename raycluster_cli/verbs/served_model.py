"""The model folder this machine last served to a cluster, so that `up` can give a host added later its copy.

A node reads the served model from its own cache (delivery/model_relay.py), under the folder's digest; a host that
joins after `serve` has no copy, and the service could not build a pipeline on it.  `serve` notes the folder on this
machine and its digest in the cluster's state folder; `up`, before it tells the running service of the nodes it
started, relays that folder to the hosts that lack it (the relay skips the ones that hold it).  A folder that is
gone or changed since (another digest) is not sent: `up` says so, and `serve --model-path DIR` again relays it.
"""

from __future__ import annotations

import json
from pathlib import Path

from raycluster_cli.config.inventory import Inventory
from raycluster_cli.config.state import ensure_private_dir, state_dir
from raycluster_cli.delivery.model_relay import place_model
from raycluster_cli.delivery.models import ModelFolder
from raycluster_cli.progress import Progress, quiet
from raycluster_cli.transport.pool import Connect

RECORD = "served-model.json"


def remember(inventory: Inventory, model: ModelFolder) -> None:
    folder = ensure_private_dir(state_dir(inventory))
    text = json.dumps({"folder": str(model.root.resolve()), "digest": model.digest})
    (folder / RECORD).write_text(text + "\n")


def forget(inventory: Inventory) -> None:
    (state_dir(inventory) / RECORD).unlink(missing_ok=True)


def relay_to_new_hosts(inventory: Inventory, connect: Connect, progress: Progress = quiet) -> str | None:
    """The served folder onto every host that lacks it; a warning when it cannot be (None: done or nothing to do)."""
    try:
        record = json.loads((state_dir(inventory) / RECORD).read_text())
        folder, digest = str(record["folder"]), str(record["digest"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # nothing served from this machine (or a path every node already had)
    if not Path(folder).is_dir():
        return f"the served model's folder {folder} is gone: a new node has no copy (raycluster serve --model-path DIR)"
    _, model, _ = place_model(inventory, connect, folder, progress)
    if model is None or model.digest != digest:
        return f"{folder} changed since it was served: a new node has no copy of the served one (serve it again)"
    return None
