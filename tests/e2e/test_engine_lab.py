"""docker.engine on the real lab: a login user outside the docker group whom sudoers lets run
/usr/bin/docker only reaches the engine through `sudo -n docker`, and through nothing else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import IP3, Lab

pytestmark = pytest.mark.lab


def _cli(the_lab: Lab, inventory_path: str, *args: str) -> tuple[int, str, str]:
    command = [sys.executable, "-m", "raycluster_cli.cli", args[0], "-i", inventory_path, *args[1:]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr


def test_engine_prefix_sudo_for_a_login_user_who_may_run_docker_only_through_sudo(
    lab_hosts: Lab, tmp_path: Path
) -> None:
    lab_hosts.sh(
        "lab-h3",
        "id rayops >/dev/null 2>&1 || useradd -m -s /bin/sh -p '*' rayops; "
        "install -d -m 700 -o rayops -g rayops /home/rayops/.ssh; "
        "install -m 600 -o rayops -g rayops /root/.ssh/authorized_keys /home/rayops/.ssh/authorized_keys; "
        "echo 'rayops ALL=(root) NOPASSWD: /usr/bin/docker' > /etc/sudoers.d/rayops; chmod 440 /etc/sudoers.d/rayops",
    )

    def as_rayops(engine: str | None) -> str:
        def edit(data: dict[str, Any]) -> None:
            data["hosts"][2]["ssh"] = {"user": "rayops"}
            if engine:
                data["hosts"][2]["docker"] = {"engine": engine}

        return lab_hosts.variant(tmp_path / f"inventory-{bool(engine)}.yaml", edit)

    code, out, _ = _cli(lab_hosts, as_rayops(None), "exec", "--json", "--host", IP3, "--", "hostname")
    assert code == 255 and "permission denied" in json.loads(out)["hosts"][0]["error"]  # plain docker: refused
    # Through sudo the engine answers and the command runs in this cluster's worker there (the cluster is up:
    # whatever state earlier modules left, `up` as root makes it so).
    code, _, err = lab_hosts.cli("up", timeout=1500)
    assert code == 0, err
    code, out, err = _cli(
        lab_hosts, as_rayops("sudo -n docker"), "exec", "--json", "--host", IP3, "--", "id -un; hostname"
    )
    host = json.loads(out)["hosts"][0]
    assert code == 0 and host["stdout"].split() == ["root", "lab-h3"], (out, err)
