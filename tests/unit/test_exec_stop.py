"""`exec` leaves nothing behind: the command built by ops.exec_command, run under the remote guard by this
machine's /bin/sh as sshd would, with a stand-in `docker` that runs `docker exec NAME ARGS…` here (like
the real one, the process it starts lives outside the caller's session, so ending the caller alone would
leave it running)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.transport import guard
from raycluster_cli.verbs.execute import exec_command

from .conftest import EXAMPLE

INV = inventory.parse(EXAMPLE)
HEAD = INV.head_host

FAKE_DOCKER = """#!/bin/sh
# docker exec NAME ARGS...: ARGS in a session of their own here, as dockerd starts them in the container
[ "$1" = exec ] || exit 125
shift 2
exec setsid -w "$@"
"""


@pytest.fixture
def fake_path(tmp_path: Path) -> dict[str, str]:
    docker = tmp_path / "docker"
    docker.write_text(FAKE_DOCKER)
    docker.chmod(0o755)
    return dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")


def _marker() -> str:
    return f"sleep 47.{int(time.time() * 1000) % 1000:03d}"


def _running(marker: str) -> bool:
    return subprocess.run(["pgrep", "-f", f"^{marker}"], capture_output=True).returncode == 0


def _end(marker: str) -> None:
    found = subprocess.run(["pgrep", "-f", f"^{marker}"], capture_output=True, text=True).stdout.split()
    for pid in found:
        subprocess.run(["kill", pid], capture_output=True)


def _until(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    return condition()


def test_output_and_exit_status_pass_through_and_the_pid_file_goes(fake_path: dict[str, str]) -> None:
    tag = f"t{os.getpid()}a"
    command = guard.guarded(exec_command(INV, HEAD, ["echo", "out;", "echo err >&2;", "exit 3"], tag=tag), 60)
    done = subprocess.run(["sh", "-c", command], capture_output=True, env=fake_path, timeout=30, start_new_session=True)
    assert (done.returncode, done.stdout, done.stderr) == (3, b"out\n", b"err\n")
    assert not Path(f"/tmp/.raycluster-exec-{tag}").exists()


def test_the_command_in_the_container_ends_when_the_connection_is_gone(fake_path: dict[str, str]) -> None:
    marker = _marker()
    tag = f"t{os.getpid()}b"
    command = guard.guarded(exec_command(INV, HEAD, [marker], tag=tag), None)
    sshd = subprocess.Popen(  # the connection's sshd: starts the session, then dies
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; subprocess.Popen(['sh', '-c', sys.argv[1]], start_new_session=True); "
            "time.sleep(60)",
            command,
        ],
        env=fake_path,
    )
    try:
        assert _until(lambda: _running(marker), 10)
        sshd.kill()
        sshd.wait()
        assert _until(lambda: not _running(marker), 8), f"{marker} still runs after its session ended"
        assert _until(lambda: not Path(f"/tmp/.raycluster-exec-{tag}").exists(), 3)
    finally:
        _end(marker)
        if sshd.poll() is None:
            sshd.kill()


def test_without_the_stop_the_container_process_would_stay(fake_path: dict[str, str]) -> None:
    """The stand-in is faithful: ending the host side of a plain `docker exec` leaves the process running."""
    marker = _marker()
    host_side = subprocess.Popen(["sh", "-c", f"docker exec x {marker}"], env=fake_path, start_new_session=True)
    try:
        assert _until(lambda: _running(marker), 10)
        os.killpg(host_side.pid, 15)
        host_side.wait(timeout=10)
        time.sleep(1)
        assert _running(marker)
    finally:
        _end(marker)


# A `docker exec` client that ends by itself after a second, leaving what it started running (as dockerd does).
DETACHING_DOCKER = """#!/bin/sh
[ "$1" = exec ] || exit 125
shift 2
setsid "$@" </dev/null >/dev/null 2>&1 &
sleep 1
"""


def test_the_command_in_the_container_ends_when_the_docker_exec_client_ends_by_itself(tmp_path: Path) -> None:
    """No signal reaches the host side here: its `docker exec` client just ends while the command runs on."""
    docker = tmp_path / "docker"
    docker.write_text(DETACHING_DOCKER)
    docker.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
    marker = _marker()
    tag = f"t{os.getpid()}d"
    command = guard.guarded(exec_command(INV, HEAD, [marker], tag=tag), None)
    host_side = subprocess.Popen(["sh", "-c", command], env=env, start_new_session=True)
    try:
        assert _until(lambda: _running(marker), 10)
        host_side.wait(timeout=20)
        assert _until(lambda: not _running(marker), 8), f"{marker} still runs after its docker exec client ended"
        assert _until(lambda: not Path(f"/tmp/.raycluster-exec-{tag}").exists(), 3)
    finally:
        _end(marker)
        if host_side.poll() is None:
            os.killpg(host_side.pid, 9)
