"""Ctrl-C and SIGTERM to a real `raycluster` process, and the interrupted --json document — without a lab.

The host is a local socket that accepts SSH connections and never says a word (a frozen sshd): the verb
waits in its login until the signal arrives.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from raycluster_cli import checks
from raycluster_cli.cli import app as cli
from raycluster_cli.errors import ExitCode


class SilentServer:
    def __init__(self, port: int, held: list[socket.socket]) -> None:
        self.port = port
        self.held = held

    def wait_for_connection(self, process: subprocess.Popen[str], timeout: float = 60) -> None:
        """Until the CLI has dialled (so it runs and its signal handlers are in place). A CLI that ended
        before dialling fails the test at once with its exit status and stderr (it used to wait the whole
        timeout and then say only "never connected", e.g. when the inventory was refused with exit 2)."""
        deadline = time.monotonic() + timeout
        while not self.held and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self.held and process.poll() is not None:
            out, err = process.communicate()
            pytest.fail(f"the CLI ended (exit {process.returncode}) before it dialled:\n{err}{out}")
        assert self.held, f"the CLI never connected within {timeout:.0f}s"


@pytest.fixture
def silent_port() -> Iterator[SilentServer]:
    """A TCP port on loopback that accepts connections and never sends an SSH banner."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield SilentServer(int(server.getsockname()[1]), held)
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def _inventory(tmp_path: Path, port: int, hosts: int = 1) -> Path:
    path = tmp_path / "inventory.yaml"
    lines = "".join(f"  - {{address: 127.0.0.{i + 1}, role: {'head' if i == 0 else 'worker'}}}\n" for i in range(hosts))
    path.write_text(
        "cluster: t\nimage: raycluster/node:0.1.0\n"
        f"ssh: {{port: {port}, known_hosts_file: {tmp_path / 'kh'}, connect_timeout_s: 60, connect_retries: 0}}\n"
        f"hosts:\n{lines}"
    )
    return path


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("verb", ["doctor", "up", "down"])
def test_a_signal_stops_the_verb_within_5s_with_one_json_document(
    tmp_path: Path, silent_port: SilentServer, signum: signal.Signals, verb: str
) -> None:
    inv = _inventory(tmp_path, silent_port.port, hosts=3)
    env = {**os.environ, "RAYCLUSTER_STATE_DIR": str(tmp_path / "state")}
    process = subprocess.Popen(
        [sys.executable, "-m", "raycluster_cli.cli", verb, "-i", str(inv), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # like a shell with job control: the signal is not ignored
    )
    silent_port.wait_for_connection(process)  # every host now waits for its banner (60 s deadline)
    time.sleep(0.5)
    assert process.poll() is None
    sent = time.monotonic()
    process.send_signal(signum)
    # More Ctrl-C while it stops must not print a traceback. Sent back to back, a second signal is merged
    # by the kernel into the first one still pending (the test could not fail); so keep sending until it
    # has ended, which lands signals in its handler, its cleanup and its exit.
    while process.poll() is None and time.monotonic() - sent < 10:
        time.sleep(0.002)
        process.send_signal(signum)
    out, err = process.communicate(timeout=10)
    assert time.monotonic() - sent <= 5
    assert process.returncode == ExitCode.INTERRUPTED, err
    assert "Traceback" not in err and "interrupted" in err
    doc = json.loads(out)
    assert doc["ok"] is False and doc["error"]["message"] == "interrupted"
    assert doc["interrupted"]["signal"] == signum.name


def test_an_interrupted_json_run_prints_one_document(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(checks, "run_checks", interrupted)
    result = CliRunner().invoke(cli.app, ["doctor", "-i", str(_inventory(tmp_path, 1)), "--json"])
    assert result.exit_code == ExitCode.INTERRUPTED
    doc = json.loads(result.stdout)
    assert doc["ok"] is False and doc["interrupted"]["running"] == [] and doc["interrupted"]["done"] == []
