"""The front end's CPU: this process's, and the Serve proxy's found by its process title beside it."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

from raycluster_cli.serve.frontend import PROXY_TITLE, FrontEndCpu


def _proxy() -> subprocess.Popen[bytes]:
    """A process titled as Ray titles its proxy actor (its argv[0]), a child of this test's process, which stands
    for the node's raylet (the parent of the ingress and of the proxy)."""
    return subprocess.Popen([PROXY_TITLE, "60"], executable=shutil.which("sleep"))


@pytest.fixture
def proxy() -> Iterator[subprocess.Popen[bytes]]:
    process = _proxy()
    yield process
    process.kill()
    process.wait()


def test_the_proxy_beside_the_ingress_is_found_and_found_again_once_replaced(proxy: subprocess.Popen[bytes]) -> None:
    front = FrontEndCpu(parent=os.getpid())
    first = front.read()
    assert first["ingress_pid"] == os.getpid() and first["ingress_cpu_s"] > 0
    assert first["proxy_pid"] == proxy.pid and first["proxy_cpu_s"] >= 0
    proxy.kill()
    proxy.wait()
    assert front.read()["proxy_pid"] is None  # gone: not reported as alive
    again = _proxy()
    try:
        deadline = time.monotonic() + 10
        while (found := front.read()["proxy_pid"]) != again.pid and time.monotonic() < deadline:
            time.sleep(0.05)
        assert found == again.pid
    finally:
        again.kill()
        again.wait()


def test_a_proxy_of_another_node_is_not_this_ones(proxy: subprocess.Popen[bytes]) -> None:
    """A proxy titled the same under another raylet (the lab's hosts share one machine's processes)."""
    assert FrontEndCpu(parent=os.getppid()).read()["proxy_pid"] != proxy.pid


def test_without_a_proxy_on_the_node_only_the_ingress_is_reported() -> None:
    body = FrontEndCpu(parent=os.getpid()).read()
    assert body["ingress_cpu_s"] > 0 and body["proxy_pid"] is None and body["proxy_cpu_s"] is None
