"""The real lab: 3 hosts (sshd + dockerd each) on a private Docker network made by the tests."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from raycluster_cli import lab

REQUIRE = os.environ.get("RAYCLUSTER_REQUIRE_LAB") == "1"
# The lab hosts' addresses (the subnet comes from RAYCLUSTER_LAB_SUBNET, 10.77.0.0/24 by default).
IP1, IP2, IP3 = (h.address for h in lab.lab_hosts(3))
UNUSED_IP = str(ipaddress.ip_network(lab.DEFAULT_SUBNET).network_address + 99)  # in the subnet, on no host


@dataclass
class Lab:
    info: lab.LabInfo

    @property
    def inventory(self) -> str:
        return str(self.info.inventory_path)

    def host(self, hostname: str) -> lab.LabHost:
        return next(h for h in self.info.hosts if h.hostname == hostname)

    def cli(self, *args: str, timeout: float = 600, inventory: str | None = None) -> tuple[int, dict[str, Any], str]:
        """Run `raycluster ARGS -i <lab inventory> --json` as a real process."""
        command = [sys.executable, "-m", "raycluster_cli.cli", *args, "-i", inventory or self.inventory, "--json"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
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
            [lab.docker_cli(), "exec", self.host(hostname).name, "sh", "-c", script],
            capture_output=True,
            text=True,
            timeout=180,
        )


def _engine_answers() -> bool:
    try:
        lab.docker_client()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def lab_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    if not _engine_answers():
        if REQUIRE:
            pytest.fail("RAYCLUSTER_REQUIRE_LAB=1 but no Docker engine answers (run scripts/ensure-docker.sh)")
        pytest.skip("no Docker engine: lab tests skipped")
    lab_dir = Path(tmp_path_factory.mktemp("lab"))
    # This session's own cluster state (the token): never shared with another lab or a user's cluster.
    os.environ["RAYCLUSTER_STATE_DIR"] = str(tmp_path_factory.mktemp("state"))
    info = lab.lab_up(3, lab_dir=lab_dir, progress=lambda m: print(f"[lab] {m}", file=sys.stderr))
    # The lab must exist before anything dials it.
    for host in info.hosts:
        assert lab.docker_client().containers.get(host.name).status == "running"
    the_lab = Lab(info)
    # Lab hosts keep their engines' volumes between sessions: start from no cluster at all.
    subprocess.run(
        [sys.executable, "-m", "raycluster_cli.cli", "down", "-i", the_lab.inventory],
        capture_output=True,
        timeout=300,
    )
    yield the_lab
    subprocess.run(
        [sys.executable, "-m", "raycluster_cli.cli", "down", "-i", the_lab.inventory],
        capture_output=True,
        timeout=300,
    )
    lab.lab_down(lab_dir=lab_dir, keep_volumes=os.environ.get("RAYCLUSTER_LAB_PURGE") != "1")
