"""docker.engine: one place turns every `docker …` command into the host's engine."""

from __future__ import annotations

import io
import subprocess

import pytest

from raycluster_cli import inventory
from raycluster_cli.engine import EngineTransport, engine_of, preamble, with_engine
from raycluster_cli.errors import InventoryError
from raycluster_cli.transport.fake import FakeTransport

from .conftest import EXAMPLE


def test_engine_is_cluster_wide_with_a_per_host_override() -> None:
    inv = inventory.parse(
        EXAMPLE.replace("role: worker}", "role: worker, docker: {engine: podman}}", 1)
        + "docker: {engine: 'sudo  -n docker'}\n"
    )
    assert [engine_of(inv, h) for h in inv.hosts] == ["sudo -n docker", "podman", "sudo -n docker"]
    assert engine_of(inventory.parse(EXAMPLE), inventory.parse(EXAMPLE).hosts[0]) == "docker"


@pytest.mark.parametrize("bad", ["docker; rm -rf /", "$(evil)", "", "'unbalanced"])
def test_an_engine_with_shell_syntax_is_refused(bad: str) -> None:
    with pytest.raises(InventoryError, match=r"docker\.engine"):
        inventory.parse(EXAMPLE + f"docker: {{engine: {bad!r}}}\n")


def test_plain_docker_is_the_transport_itself_and_other_engines_get_the_preamble() -> None:
    inv = inventory.parse(EXAMPLE + "docker: {engine: podman}\n")
    fake = FakeTransport("192.0.2.11", {".": "ok"})
    assert with_engine(inventory.parse(EXAMPLE), inv.hosts[0], fake) is fake
    wrapped = with_engine(inv, inv.hosts[0], fake)
    assert isinstance(wrapped, EngineTransport) and wrapped.host == "192.0.2.11"
    wrapped.run("docker ps -a | grep x && docker rm -f x")
    wrapped.feed("docker load", io.BytesIO(b"image"))
    assert fake.commands == [
        'docker() { podman "$@"; }; docker ps -a | grep x && docker rm -f x',
        'docker() { podman "$@"; }; docker load',
    ]
    wrapped.put(b"data", "/etc/x")
    assert fake.files["/etc/x"] == (b"data", 0o600)


def test_the_preamble_makes_every_docker_word_of_a_pipeline_the_engine() -> None:
    script = preamble("echo ENGINE") + "docker ps | tr a-z A-Z; docker info && docker save img | wc -c"
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["ENGINE PS", "ENGINE info", "16"]  # "ENGINE save img" + newline: 16 bytes
    assert preamble("docker") == ""
