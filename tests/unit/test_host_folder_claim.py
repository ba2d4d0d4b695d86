"""The cluster's host state folder is claimed only when raycluster made it (issue 34, item 9): `up` used an
existing `<host_state_dir>/<cluster>` whoever owned it and whatever it held, chmod-ed it 0700 (with sudo:
chowned it to the login user), and `down --purge` ran `rm -rf` on it. The commands run here for real with `sh`
on this machine's file system (a folder of another user made with chown: the tests run as root)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.errors import OperationError
from raycluster_cli.host import folders
from raycluster_cli.host.node import Plan, start_command

NOBODY = 65534


def inv(state: Path) -> inventory.Inventory:
    return inventory.parse(
        f"cluster: demo\nimage: raycluster/node:0.1.0\nhost_state_dir: {state}\n"
        "hosts:\n  - {address: 192.0.2.1, role: head}\n",
        "inv.yaml",
    )


def sh(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)


@pytest.fixture
def state(tmp_path: Path) -> Path:
    (tmp_path / "state").mkdir()
    return tmp_path / "state"


def _make(state: Path) -> subprocess.CompletedProcess[str]:
    i = inv(state)
    return sh(folders.make_dir_command(i, i.hosts[0]))


def _remove(state: Path) -> subprocess.CompletedProcess[str]:
    i = inv(state)
    return sh(folders.remove_dir_command(i, i.hosts[0]))


def _refused(done: subprocess.CompletedProcess[str], doing: str) -> str:
    i = inv(Path("/x"))
    error = folders.refusal(i, i.hosts[0], done.stderr, doing)
    assert done.returncode != 0 and error is not None, (done.returncode, done.stderr)
    return error.message


def test_a_new_folder_is_marked_and_down_purge_removes_it(state: Path) -> None:
    assert _make(state).returncode == 0
    folder = state / "demo"
    assert (folder / folders.MARKER).read_text() == "raycluster cluster demo\n"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    (folder / "auth-token").write_text("t")
    assert _make(state).returncode == 0  # again: ours
    done = _remove(state)
    assert done.returncode == 0 and done.stdout == "removed\n" and not folder.exists()


def test_a_folder_of_another_user_is_neither_used_nor_changed_nor_removed(state: Path) -> None:
    folder = state / "demo"
    folder.mkdir(mode=0o755)
    (folder / "data.db").write_text("someone's")
    os.chown(folder, NOBODY, NOBODY)
    message = _refused(_make(state), "raycluster will not use it")
    assert "192.0.2.1: /x/demo is not raycluster's folder, so raycluster will not use it: it belongs to" in message
    assert "not to root" in message
    assert folder.stat().st_uid == NOBODY and stat.S_IMODE(folder.stat().st_mode) == 0o755  # was: chmod 700
    assert "down --purge leaves it" in _refused(_remove(state), "down --purge leaves it")
    assert (folder / "data.db").read_text() == "someone's"  # was: rm -rf


def test_an_unmarked_folder_holding_other_files_is_refused(state: Path) -> None:
    folder = state / "demo"
    folder.mkdir()
    (folder / "auth-token").write_text("t")
    (folder / "notes.txt").write_text("mine")
    assert "it holds notes.txt, which raycluster does not write, and no .raycluster-cluster" in _refused(
        _make(state), "x"
    )
    assert not (folder / folders.MARKER).exists()
    _refused(_remove(state), "x")
    assert (folder / "notes.txt").exists()


def test_a_folder_from_before_the_marker_is_adopted(state: Path) -> None:
    """An `up` before the marker left the token, the env files and the model cache: marked and used."""
    folder = state / "demo"
    (folder / "models").mkdir(parents=True)
    for name in ("auth-token", "head.env", "worker.env", "auth-token.raycluster-tmp"):
        (folder / name).write_text("x")
    assert _make(state).returncode == 0
    assert (folder / folders.MARKER).exists()
    folder.joinpath(folders.MARKER).unlink()  # down --purge of one never marked, too
    assert _remove(state).stdout == "removed\n" and not folder.exists()


def test_a_link_a_file_or_another_clusters_marker_is_refused(state: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (state / "demo").symlink_to(elsewhere)
    assert "it is a link or a file, not a folder" in _refused(_make(state), "x")
    assert "it is a link or a file" in _refused(_remove(state), "x")
    assert elsewhere.exists() and (state / "demo").is_symlink()
    (state / "demo").unlink()
    (state / "demo").write_text("a file")
    assert "it is a link or a file" in _refused(_make(state), "x")
    (state / "demo").unlink()
    (state / "demo").mkdir()
    (state / "demo" / folders.MARKER).write_text("raycluster cluster other\n")
    assert "its .raycluster-cluster names another cluster" in _refused(_make(state), "x")


def test_up_reports_the_refusal_with_host_path_and_fix(state: Path) -> None:
    """`up`'s one remote command per host (start_command) fails on the folder, before writing anything."""
    folder = state / "demo"
    folder.mkdir()
    os.chown(folder, NOBODY, NOBODY)
    i = inv(state)
    command, stdin = start_command(i, i.hosts[0], Plan("keep", ""), {f"{folder}/auth-token": b"s3cret"})
    done = subprocess.run(["sh", "-c", command], input=stdin, capture_output=True, timeout=30)
    assert done.returncode == 89 and not (folder / "auth-token").exists()
    error = folders.refusal(i, i.hosts[0], done.stderr.decode(), "raycluster will not use it")
    assert isinstance(error, OperationError)
    assert error.hint.startswith(f"on 192.0.2.1, move {folder} aside")
