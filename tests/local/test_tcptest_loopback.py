"""The built-in TCP test of `doctor --network`, server and client on loopback (real sockets, stdin-fed script)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path

from raycluster_cli.checks import tcptest
from raycluster_cli.checks.network import parse_tcptest

SCRIPT = Path(tcptest.__file__).read_bytes()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_script_on_stdin_measures_both_directions() -> None:
    port = _free_port()
    python = [sys.executable, "-"]
    server = subprocess.Popen([*python, "serve", "127.0.0.1", str(port), "30"], stdin=subprocess.PIPE)
    assert server.stdin is not None
    server.stdin.write(SCRIPT)
    server.stdin.close()
    client = subprocess.run(
        [*python, "measure", "127.0.0.1", str(port), "0.5"], input=SCRIPT, capture_output=True, timeout=60
    )
    assert server.wait(timeout=30) == 0  # the client's quit ends the server
    figures = parse_tcptest(client.stdout.decode())
    assert figures is not None, client.stderr.decode()
    assert 0 < figures["rtt_ms"] < 100
    assert figures["up_bps"] > 1e6 and figures["down_bps"] > 1e6


def test_server_gives_up_when_idle() -> None:
    port = _free_port()
    thread = threading.Thread(target=tcptest.serve, args=("127.0.0.1", port, 0.3))
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()
