"""The operator's state: 0700 folders, a token written whole or not at all and checked when read, a lock
per cluster held by one process at a time (tested with two real processes)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from raycluster_cli.cli import app as cli
from raycluster_cli.config import inventory, state
from raycluster_cli.errors import ExitCode, OperationError

INV = "cluster: demo\nimage: raycluster/node:0.1.0\nhosts:\n  - {address: 192.0.2.11, role: head}\n"


@pytest.fixture
def inv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> inventory.Inventory:
    monkeypatch.setenv("RAYCLUSTER_STATE_DIR", str(tmp_path / "state"))
    return inventory.parse(INV)


def test_token_is_made_once_0600_in_0700_folders(inv: inventory.Inventory, tmp_path: Path) -> None:
    token = state.ensure_token(inv)
    path = state.token_file(inv)
    assert len(token) == 64 and path.read_bytes() == token
    assert path.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert state.ensure_token(inv) == token
    assert [p.name for p in path.parent.iterdir()] == ["auth-token"], "a temp file was left"


def test_existing_folders_get_mode_0700(inv: inventory.Inventory, tmp_path: Path) -> None:
    folder = tmp_path / "state" / "demo"
    folder.mkdir(parents=True, mode=0o755)
    (tmp_path / "state").chmod(0o755)
    folder.chmod(0o755)
    state.ensure_token(inv)
    assert folder.stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize(
    ("content", "says"), [(b"", "is empty"), (b"\n", "is empty"), (b"3f2a", "is malformed (4 bytes")]
)
def test_an_empty_or_cut_token_is_never_used(inv: inventory.Inventory, content: bytes, says: str) -> None:
    path = state.token_file(inv)
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with pytest.raises(OperationError) as info:
        state.ensure_token(inv)
    assert f"the Ray token file {path} {says}" in info.value.message
    assert f"rm {path}" in info.value.hint


def test_a_write_that_fails_half_way_leaves_no_token(inv: inventory.Inventory, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OperationError, match=r"cannot write the Ray token in .*: No space left on device"):
        state.ensure_token(inv)
    assert list(state.state_dir(inv).iterdir()) == []
    monkeypatch.undo()


_HOLDER = """
import sys, time
from pathlib import Path
from raycluster_cli.config import inventory, state
inv = inventory.parse(sys.argv[1])
with state.cluster_lock(inv, "up"):
    print("locked", flush=True)
    Path(sys.argv[2]).exists() or time.sleep(float(sys.argv[3]))
"""


def _holder(hold_s: float, tmp_path: Path) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, INV, str(tmp_path / "release"), str(hold_s)],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "locked"
    return process


def test_a_second_process_is_refused_naming_the_first(inv: inventory.Inventory, tmp_path: Path) -> None:
    first = _holder(60, tmp_path)
    try:
        started = time.monotonic()
        with pytest.raises(state.ClusterBusy) as info, state.cluster_lock(inv, "down", wait_s=0.5):
            pass
        assert time.monotonic() - started < 5
        message = info.value.message
        assert message.startswith("cluster demo is busy: `raycluster up` (pid ")
        assert f"(pid {first.pid} on " in message and str(state.state_dir(inv) / "lock") in message
        assert "kill" in info.value.hint
    finally:
        first.kill()
        first.wait()
    with state.cluster_lock(inv, "down", wait_s=0):  # the lock went with the process
        pass


def test_a_second_process_waits_for_a_short_first(inv: inventory.Inventory, tmp_path: Path) -> None:
    first = _holder(1.0, tmp_path)
    said: list[object] = []
    with state.cluster_lock(inv, "down", wait_s=30, progress=said.append):
        assert first.wait(5) == 0
    assert said and "is busy (`raycluster up`" in str(said[0])


def test_up_refuses_while_another_up_runs(
    inv: inventory.Inventory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text(INV)
    monkeypatch.setattr(state, "LOCK_WAIT_S", 0.3)
    first = _holder(60, tmp_path)
    try:
        result = CliRunner().invoke(cli.app, ["up", "-i", str(path), "--json"])
    finally:
        first.kill()
        first.wait()
    assert result.exit_code == ExitCode.FAILED
    assert "cluster demo is busy: `raycluster up` (pid" in result.stdout


def test_purge_keeps_only_the_lock(inv: inventory.Inventory) -> None:
    state.ensure_token(inv)
    (state.state_dir(inv) / "images").mkdir()
    with state.cluster_lock(inv, "down"):
        assert state.purge_local(inv) == state.state_dir(inv)
        assert [p.name for p in state.state_dir(inv).iterdir()] == ["lock"]
    state.purge_local(inv)
    state.state_dir(inv).joinpath("lock").unlink()
    assert state.purge_local(inv) == state.state_dir(inv) and not state.state_dir(inv).exists()
