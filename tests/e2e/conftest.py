"""The real labs: 3 hosts with the node image (sshd + dockerd each) on a private Docker network made by the
tests, and (for the fleet tests, marked `fleet`) a second lab of many hosts without the node image beside it."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from raycluster_cli.lab import hosts as lab

REQUIRE = os.environ.get("RAYCLUSTER_REQUIRE_LAB") == "1"
# The engine's own client (/usr/bin/docker from Debian's docker.io), else the one on PATH: tests act on the lab
# hosts the way their administrator would.
DOCKER = "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else (shutil.which("docker") or "docker")
# The fleet lab: its own name and subnet, so that it lives beside the 3-host lab in one session.
FLEET_NAME = os.environ.get("RAYCLUSTER_FLEET_LAB_NAME", f"{lab.LAB_NAME}-fleet")
FLEET_SUBNET_DEFAULT = "10.79.0.0/24"  # 10.78: the network test
FLEET_HOSTS = int(os.environ.get("RAYCLUSTER_FLEET_HOSTS", "30"))
# The lab hosts' addresses (the subnet comes from RAYCLUSTER_LAB_SUBNET, 10.77.0.0/24 by default).
IP1, IP2, IP3 = (h.address for h in lab.lab_hosts(3))
UNUSED_IP = str(ipaddress.ip_network(lab.DEFAULT_SUBNET).network_address + 99)  # in the subnet, on no host


def keep_report(variable: str, name: str, document: dict[str, Any]) -> None:
    """Write ``document`` to DIR/``name`` when the environment sets ``variable`` to DIR: the figures behind
    docs/PERFORMANCE.md, kept from a lab run."""
    folder = os.environ.get(variable)
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / name).write_text(json.dumps(document, indent=2) + "\n")


def lab_subnet(variable: str, default: str, name: str) -> str:
    """A second lab's subnet: the environment's `variable` if set, else `default` unless another Docker network
    holds it (a lab left by an interrupted run), then a free one (lab.free_subnet)."""
    given = os.environ.get(variable)
    return given if given else lab.free_subnet(default, name)


@dataclass
class Lab:
    info: lab.LabInfo

    @property
    def inventory(self) -> str:
        return str(self.info.inventory_path)

    def host(self, hostname: str) -> lab.LabHost:
        return next(h for h in self.info.hosts if h.hostname == hostname)

    def cli(
        self, *args: str, timeout: float = 600, inventory: str | None = None, env: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any], str]:
        """Run `raycluster ARGS -i <lab inventory> --json` as a real process (the command's own path: cli/entry.py);
        `env` changes its environment (another operator's state folder, say)."""
        command = [sys.executable, "-m", "raycluster_cli", *args, "-i", inventory or self.inventory, "--json"]
        environment = os.environ | env if env else None
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment)
        try:
            document = json.loads(done.stdout)
        except ValueError:
            pytest.fail(f"no JSON document from {args}: rc={done.returncode}\n{done.stdout}\n{done.stderr}")
        return done.returncode, document, done.stderr

    def variant(self, path: Path, edit: Callable[[dict[str, Any]], None]) -> str:
        """Write a copy of the lab inventory changed by `edit` to `path`."""
        data = yaml.safe_load(self.info.inventory_path.read_text())
        edit(data)
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return str(path)

    def sh(self, hostname: str, script: str) -> str:
        """Run a shell script on a lab host (as its administrator would); it must succeed; return stdout."""
        done = self.sh_result(hostname, script)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def sh_result(self, hostname: str, script: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [DOCKER, "exec", self.host(hostname).name, "sh", "-c", script],
            capture_output=True,
            text=True,
            timeout=180,
        )

    @contextmanager
    def shim(self, hostname: str, command: str, script: str) -> Iterator[None]:
        """`script` as /usr/local/bin/`command` on a lab host (in front of the real one on every login's PATH)
        until the block ends."""
        path = f"/usr/local/bin/{command}"
        self.sh(hostname, f"cat > {path} <<'EOF'\n{script}EOF\nchmod +x {path}")
        try:
            yield
        finally:
            self.sh_result(hostname, f"rm -f {path}")

    def start_engine(self, hostname: str, timeout_s: float = 60.0) -> None:
        """(Re)start a lab host's own dockerd (as its init would) and wait until it answers."""
        self.sh(hostname, "/usr/local/sbin/labhost-start-dockerd")
        deadline = time.monotonic() + timeout_s
        while self.sh_result(hostname, "docker info >/dev/null").returncode != 0:
            assert time.monotonic() < deadline, f"{hostname}: dockerd did not start"
            time.sleep(0.5)


def _engine_answers() -> bool:
    try:
        lab.docker_client()
        return True
    except Exception:
        return False


def _need_engine() -> None:
    if not _engine_answers():
        if REQUIRE:
            pytest.fail("RAYCLUSTER_REQUIRE_LAB=1 but no Docker engine answers (run scripts/ensure-docker.sh)")
        pytest.skip("no Docker engine: lab tests skipped")


@pytest.fixture(scope="session")
def session_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This session's own cluster state (the token): never shared with another lab or a user's cluster."""
    state = Path(tmp_path_factory.mktemp("state"))
    os.environ["RAYCLUSTER_STATE_DIR"] = str(state)
    return state


@pytest.fixture(scope="session")
def fleet_lab(tmp_path_factory: pytest.TempPathFactory, session_state: Path) -> Iterator[Lab]:
    """A second lab of FLEET_HOSTS hosts without the node image (no Ray), beside the 3-host lab."""
    _need_engine()
    lab_dir = Path(tmp_path_factory.mktemp("fleet"))
    progress = lambda m: print(f"[fleet] {m}", file=sys.stderr)  # noqa: E731
    subnet = lab_subnet("RAYCLUSTER_FLEET_SUBNET", FLEET_SUBNET_DEFAULT, FLEET_NAME)
    info = lab.lab_up(
        FLEET_HOSTS, lab_dir=lab_dir, name=FLEET_NAME, subnet=subnet, load_node_image=False, progress=progress
    )
    yield Lab(info)
    lab.lab_down(lab_dir=lab_dir, name=FLEET_NAME, keep_volumes=os.environ.get("RAYCLUSTER_LAB_PURGE") != "1")


@pytest.fixture(scope="session")
def lab_hosts(tmp_path_factory: pytest.TempPathFactory, session_state: Path) -> Iterator[Lab]:
    _need_engine()
    lab_dir = Path(tmp_path_factory.mktemp("lab"))
    info = lab.lab_up(3, lab_dir=lab_dir, progress=lambda m: print(f"[lab] {m}", file=sys.stderr))
    # The lab must exist before anything dials it.
    for host in info.hosts:
        assert lab.docker_client().containers.get(host.name).status == "running"
    the_lab = Lab(info)
    # Lab hosts keep their engines' volumes between sessions: start from no cluster at all.
    subprocess.run(
        [sys.executable, "-m", "raycluster_cli", "down", "-i", the_lab.inventory],
        capture_output=True,
        timeout=300,
    )
    yield the_lab
    subprocess.run(
        [sys.executable, "-m", "raycluster_cli", "down", "-i", the_lab.inventory],
        capture_output=True,
        timeout=300,
    )
    lab.lab_down(lab_dir=lab_dir, keep_volumes=os.environ.get("RAYCLUSTER_LAB_PURGE") != "1")
