"""`up` gives a host added after `serve` its copy of the served model: what `serve` notes, and what `up` says when it
cannot send it (no record: nothing; the folder gone: a warning naming the fix)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raycluster_cli.config.inventory import parse
from raycluster_cli.delivery.models import read_model_folder
from raycluster_cli.verbs import served_model

INVENTORY = """
cluster: demo
image: rayproject/ray:2.60.0
ssh: {user: root}
hosts:
  - {address: 10.0.0.1, role: head}
  - {address: 10.0.0.2, role: worker}
"""


def _unreachable(host: object) -> object:
    raise AssertionError(f"no host is reached when there is nothing to send: {host}")


def test_serve_notes_the_folder_and_up_warns_once_it_is_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYCLUSTER_STATE_DIR", str(tmp_path / "state"))
    inventory = parse(INVENTORY)
    assert served_model.relay_to_new_hosts(inventory, _unreachable) is None  # nothing served from here
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    model = read_model_folder(folder)
    served_model.remember(inventory, model)
    record = json.loads((tmp_path / "state" / "demo" / served_model.RECORD).read_text())
    assert record == {"folder": str(folder.resolve()), "digest": model.digest}
    (folder / "config.json").unlink()
    folder.rmdir()
    warning = served_model.relay_to_new_hosts(inventory, _unreachable)
    assert warning is not None and str(folder.resolve()) in warning and "serve --model-path" in warning
    served_model.forget(inventory)
    assert served_model.relay_to_new_hosts(inventory, _unreachable) is None
