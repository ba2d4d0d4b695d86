import socket

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
