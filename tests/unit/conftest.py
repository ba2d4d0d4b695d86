import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

EXAMPLE = """
cluster: demo
image: raycluster/node:0.1.0
ssh: {user: root, key: ~/.ssh/id_ed25519, port: 22, known_hosts: strict}
head: {address: 192.0.2.11}
hosts:
  - {address: 192.0.2.11, role: head}
  - {address: 192.0.2.12, role: worker}
  - {address: 192.0.2.13, role: worker, docker: {run_options: ["--cpus=0.5"]}}
"""


def refusing_inventory(tmp_path: Path, ssh: str) -> Path:
    """A one-host inventory whose host is a loopback port nothing listens on (the login is refused at once);
    ``ssh``: more keys of its ``ssh`` mapping, e.g. ``"connect_retries: 0"``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(
        "cluster: t\nimage: raycluster/node:0.1.0\n"
        f"ssh: {{port: {port}, key: null, known_hosts_file: {tmp_path / 'kh'}, {ssh}}}\n"
        "hosts:\n  - {address: 127.0.0.1, role: head}\n"
    )
    return inventory


@pytest.fixture
def example_yaml() -> str:
    return EXAMPLE


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit tests open no connections at all."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a unit test tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


class Clock:
    """Simulated time for transport/sshio.py: `monotonic` reads it, `sleep` advances it by exactly its length.

    sshio's only waits are `time.sleep` and a channel's own timeout (fakes sleep through `sshio.time`), so a
    deadline is judged against the fake's sequence of events, not against how a loaded machine scheduled this
    process (there a 10 ms sleep can last 300 ms)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    from raycluster_cli.transport import sshio

    fake = Clock()
    monkeypatch.setattr(sshio, "time", SimpleNamespace(monotonic=fake.monotonic, sleep=fake.sleep))
    return fake
