"""docker.engine: one place turns every `docker …` command into the host's engine."""

from __future__ import annotations

import io
import subprocess
from pathlib import Path

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.errors import InventoryError
from raycluster_cli.transport.engine_shim import EngineTransport, engine_of, preamble, with_engine
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
        preamble("podman") + "docker ps -a | grep x && docker rm -f x",
        preamble("podman") + "docker load",
    ]
    wrapped.put(b"data", "/etc/x")
    assert fake.files["/etc/x"] == (b"data", 0o600)


def _sh(script: str, home: Path, path: str = "/usr/bin:/bin") -> str:
    env = {"HOME": str(home), "PATH": path}
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True, env=env).stdout


def test_the_preamble_makes_every_docker_word_the_engine_in_pipelines_timeout_and_nested_shells(
    tmp_path: Path,
) -> None:
    script = preamble("echo ENGINE") + (
        "docker ps | tr a-z A-Z; docker info && docker save img | wc -c; timeout 5 docker top x; "
        "bash -c 'docker load -q'"
    )
    out = _sh(script, tmp_path)
    assert out.splitlines() == ["ENGINE PS", "ENGINE info", "16", "ENGINE top x", "ENGINE load -q"]
    assert _sh(script, tmp_path) == out  # the shim, once written, is reused
    (shim,) = (tmp_path / ".cache" / "raycluster").glob("engine-*/docker")
    assert oct(shim.stat().st_mode & 0o777) == "0o700"
    assert preamble("docker") == ""


def test_an_engine_that_is_docker_with_options_runs_the_real_docker_not_the_shim_again(tmp_path: Path) -> None:
    real = tmp_path / "bin"
    real.mkdir()
    (real / "docker").write_text('#!/bin/sh\necho "REAL $*"\n')
    (real / "docker").chmod(0o755)
    out = _sh(preamble("docker --tls") + "docker ps -q", tmp_path, f"{real}:/usr/bin:/bin")
    assert out == "REAL --tls ps -q\n"


def test_a_home_where_the_shim_cannot_be_written_fails_the_command_with_a_message(tmp_path: Path) -> None:
    done = subprocess.run(
        ["sh", "-c", preamble("podman") + "echo ran"],
        capture_output=True,
        text=True,
        env={"HOME": "/proc/none", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 125 and "ran" not in done.stdout and "engine shim" in done.stderr


def test_a_streamed_command_gets_the_engines_preamble_once() -> None:
    """logs and exec stream their output through the SSH transport's `stream`: the engine applies there too."""

    class Streaming(FakeTransport):
        def stream(self, command: str, on_output: object, **options: object) -> int:
            self.commands.append(command)
            return 0

    inner = Streaming("192.0.2.11", {})
    inv = inventory.parse(EXAMPLE + "docker: {engine: podman}\n")
    wrapped = with_engine(inv, inv.hosts[0], inner)
    assert wrapped.stream("docker logs x", lambda stream, data: None, timeout=5) == 0  # type: ignore[attr-defined]
    assert inner.commands == [preamble("podman") + "docker logs x"]
