"""A non-root login on the real lab: `rayuser` is in the docker group on lab-h1 and lab-h2, and on lab-h3 may run
only docker, install and rm through `sudo -n` (docker.engine: sudo -n docker, ssh.sudo: true). doctor passes,
up brings every node alive, status is healthy, down --purge removes what up made; a user without Docker
access fails doctor with the fix. The fixture makes the users and removes them, and everything of the
cluster `nonroot`, whatever a test left."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raycluster_cli.config.inventory import load
from raycluster_cli.delivery.deliver import distribute, local_image_id
from raycluster_cli.delivery.schedule import ImageTransfer
from raycluster_cli.lab import hosts as lab
from raycluster_cli.transport.pool import SSHPool

from .conftest import DOCKER, IP2, IP3, Lab

pytestmark = pytest.mark.lab

USER = "rayuser"
NO_DOCKER = "nodocker"
CLUSTER = "nonroot"
HOSTS = ("lab-h1", "lab-h2", "lab-h3")
# An extra tag of the lab's node image: `down --purge` removes it, the lab's own tag stays for other tests.
ALIAS = lab.NODE_IMAGE + "-nonroot"
HOME_DIR = f"/home/{USER}/.local/state/raycluster/{CLUSTER}"
SUDO_DIR = f"/etc/raycluster/{CLUSTER}"


def _add_user(name: str, docker_group: bool, sudo: str = "") -> str:
    lines = [
        f"id {name} >/dev/null 2>&1 || useradd -m -s /bin/sh -p '*' {name}",
        f"install -d -m 700 -o {name} -g {name} /home/{name}/.ssh",
        f"install -m 600 -o {name} -g {name} /root/.ssh/authorized_keys /home/{name}/.ssh/authorized_keys",
    ]
    if docker_group:
        lines.append(f"usermod -aG docker {name}")
    if sudo:
        lines.append(
            f"echo '{name} ALL=(root) NOPASSWD: {sudo}' > /etc/sudoers.d/{name} && chmod 440 /etc/sudoers.d/{name}"
        )
    return " && ".join(lines)


def _clean(the_lab: Lab) -> None:
    """Remove the cluster's containers, folders and image alias, and the users (as the hosts' root would)."""
    for host in HOSTS:
        the_lab.sh_result(
            host,
            f"docker rm -f $(docker ps -aq --filter label=io.raycluster.cluster={CLUSTER}) 2>/dev/null; "
            f"docker rmi {ALIAS} 2>/dev/null; rm -rf {SUDO_DIR} /var/tmp/raycluster-images-{USER}; "
            f"for u in {USER} {NO_DOCKER}; do userdel -r $u 2>/dev/null; rm -f /etc/sudoers.d/$u; done; true",
        )


@pytest.fixture(scope="module")
def nonroot_lab(lab_hosts: Lab) -> Iterator[Lab]:
    lab_hosts.cli("down")  # the lab's own cluster would hold Ray's ports on the hosts
    _clean(lab_hosts)
    subprocess.run([DOCKER, "tag", lab.NODE_IMAGE, ALIAS], check=True, timeout=60)
    try:
        lab_hosts.sh("lab-h1", _add_user(USER, docker_group=True))
        lab_hosts.sh("lab-h2", _add_user(USER, docker_group=True) + " && " + _add_user(NO_DOCKER, docker_group=False))
        lab_hosts.sh("lab-h3", _add_user(USER, False, "/usr/bin/docker, /usr/bin/install, /usr/bin/rm"))
        # As an older root `up` left it (mkdir -p under umask 077) (CI ran root's tests first): the sudo
        # login's `up` must repair it, or its token write cannot cross /etc/raycluster.
        lab_hosts.sh("lab-h3", "mkdir -p /etc/raycluster && chmod 700 /etc/raycluster")
        yield lab_hosts
    finally:
        _clean(lab_hosts)
        subprocess.run([DOCKER, "rmi", ALIAS], capture_output=True, timeout=60)


@pytest.fixture(autouse=True)
def _alias_on_every_host(nonroot_lab: Lab) -> None:
    """Each test starts with the image alias on every host (`down --purge` of another test removes it)."""
    for host in HOSTS:
        nonroot_lab.sh(host, f"docker tag {lab.NODE_IMAGE} {ALIAS}")


def _as_user(the_lab: Lab, path: Path) -> str:
    def edit(data: dict[str, Any]) -> None:
        data["cluster"] = CLUSTER
        data["image"] = ALIAS
        data.setdefault("ssh", {})["user"] = USER
        data["hosts"][2]["docker"] = {**data["hosts"][2].get("docker", {}), "engine": "sudo -n docker"}
        data["hosts"][2]["ssh"] = {**data["hosts"][2].get("ssh", {}), "sudo": True}

    return the_lab.variant(path, edit)


def _statuses(doc: dict[str, Any], check: str) -> dict[str, str]:
    return {c["host"]: c["status"] for c in doc["checks"] if c["id"] == check}


def test_a_non_root_login_runs_doctor_up_status_and_down(nonroot_lab: Lab, tmp_path: Path) -> None:
    inventory = _as_user(nonroot_lab, tmp_path / "inventory.yaml")
    addresses = {h.address for h in nonroot_lab.info.hosts}
    try:
        code, doc, err = nonroot_lab.cli("doctor", inventory=inventory)
        assert code == 0, (err, [c for c in doc["checks"] if c["status"] != "ok"])
        for check in ("docker", "state-dir", "state-mount"):
            assert _statuses(doc, check) == dict.fromkeys(addresses, "ok"), check

        code, doc, err = nonroot_lab.cli("up", inventory=inventory)
        assert code == 0, err
        assert sorted(n["host"] for n in doc["nodes"]) == sorted(addresses) and all(n["alive"] for n in doc["nodes"])

        # The token: 0600, owned by the login user, in its home (docker group) or in /etc through sudo.
        token = (Path(os.environ["RAYCLUSTER_STATE_DIR"]) / CLUSTER / "auth-token").read_text().strip()
        for host, folder in (("lab-h1", HOME_DIR), ("lab-h2", HOME_DIR), ("lab-h3", SUDO_DIR)):
            owners = nonroot_lab.sh(host, f"stat -c '%a %U' {folder} {folder}/auth-token").split("\n")
            assert owners[:2] == [f"700 {USER}", f"600 {USER}"], (host, owners)
            inspect = nonroot_lab.sh(
                host, f"docker inspect $(docker ps -q --filter label=io.raycluster.cluster={CLUSTER})"
            )
            assert f'"{folder}/auth-token:/run/raycluster/auth-token:ro"' in inspect and token not in inspect
            assert token not in nonroot_lab.sh(host, "ps -eo args")

        assert nonroot_lab.sh("lab-h3", "stat -c %a /etc/raycluster").strip() == "755"  # repaired by sudo
        code, doc, err = nonroot_lab.cli("status", inventory=inventory)
        assert code == 0, err

        code, doc, err = nonroot_lab.cli("down", "--purge", inventory=inventory)
        assert code == 0, err
        assert {r["host"] for r in doc["removed"]} == addresses
        for host, folder in (("lab-h1", HOME_DIR), ("lab-h3", SUDO_DIR)):
            left = nonroot_lab.sh(
                host,
                f"docker ps -aq --filter label=io.raycluster.cluster={CLUSTER}; test -e {folder} && echo {folder}; "
                f"docker image inspect {ALIAS} >/dev/null 2>&1 && echo {ALIAS}; true",
            )
            assert left == "", (host, left)
            assert nonroot_lab.sh_result(host, f"docker image inspect {lab.NODE_IMAGE}").returncode == 0
    finally:
        nonroot_lab.cli("down", inventory=inventory)


def test_a_user_without_docker_access_fails_doctor_with_the_fix(nonroot_lab: Lab, tmp_path: Path) -> None:
    def edit(data: dict[str, Any]) -> None:
        data["cluster"] = CLUSTER
        data["host_state_dir"] = "/opt/raycluster"  # root-owned: that user cannot make it either
        data["hosts"][1]["ssh"] = {**data["hosts"][1].get("ssh", {}), "user": NO_DOCKER}

    code, doc, _ = nonroot_lab.cli("doctor", inventory=nonroot_lab.variant(tmp_path / "nodocker.yaml", edit))
    assert code == 1 and doc["ok"] is False
    failed = {(c["host"], c["id"]): c for c in doc["checks"] if c["status"] == "fail"}
    assert set(failed) == {(IP2, "docker"), (IP2, "state-dir")}, failed
    docker = failed[(IP2, "docker")]
    assert f"user {NO_DOCKER} may not use Docker" in docker["message"]
    assert f"on {IP2}: usermod -aG docker {NO_DOCKER}" in docker["hint"]
    assert "docker.engine: sudo -n docker" in docker["hint"]
    state = failed[(IP2, "state-dir")]
    assert (
        state["message"] == f"/opt/raycluster/{CLUSTER} cannot be made: /opt is not writable by {NO_DOCKER} (root 755)"
    )
    assert "host_state_dir: ~/.local/state/raycluster" in state["hint"] and IP2 in state["hint"]
    assert _statuses(doc, "state-dir")[IP3] == "ok"  # root on the other hosts writes it


@pytest.mark.extended
def test_a_non_root_login_is_streamed_the_image_where_root_left_its_archive_folder(
    nonroot_lab: Lab, tmp_path: Path
) -> None:
    """lab-h2 lacks the image (its alias tag) and has the 0700 archive folder a root `up` leaves: `up`'s image
    step (the library's `distribute`, real SSH and a real stream, no Ray) puts the user's copy in its own
    folder (/var/tmp/raycluster-images-rayuser), loads it, and removes the archive after."""
    loaded = load(_as_user(nonroot_lab, tmp_path / "inventory.yaml")).inventory
    nonroot_lab.sh("lab-h2", f"docker rmi {ALIAS} && install -d -m 700 /var/tmp/raycluster-images")
    pool = SSHPool(loaded)
    try:
        local_id = local_image_id(ALIAS)
        done = distribute(loaded, pool, [ImageTransfer(IP2, "missing", "stream")], local_id, tmp_path / "archives")
        assert [(t.host, t.source) for t in done] == [(IP2, "operator")]
        there = nonroot_lab.sh("lab-h2", f"docker image inspect --format '{{{{.Id}}}}' {ALIAS}").strip()
        assert there == local_id
        left = nonroot_lab.sh("lab-h2", f"ls -A /var/tmp/raycluster-images-{USER}; ls -A /var/tmp/raycluster-images")
        assert left == "", left
    finally:
        pool.close()
        nonroot_lab.sh(
            "lab-h2",
            f"rm -rf /var/tmp/raycluster-images-{USER}; rmdir /var/tmp/raycluster-images 2>/dev/null; "
            f"docker tag {lab.NODE_IMAGE} {ALIAS}",
        )
