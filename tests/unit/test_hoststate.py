"""The host state folder for non-root logins: inventory keys, the commands (run in a real shell here), the
doctor checks' judgements and their fixes."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from raycluster_cli.checks import Status, access
from raycluster_cli.checks.base import CheckContext
from raycluster_cli.checks.machine import docker
from raycluster_cli.config import inventory
from raycluster_cli.errors import InventoryError
from raycluster_cli.host import folders
from raycluster_cli.host.containers import docker_run_command, env_path_on_host, token_path_on_host
from raycluster_cli.transport.base import put_command, shell_path

BASE = """cluster: demo
image: raycluster/node:0.1.0
hosts:
  - {address: 192.0.2.11, role: head}
  - {address: 192.0.2.12, role: worker}
"""


def inv(extra: str = "", worker: str = "") -> inventory.Inventory:
    text = BASE + extra
    if worker:
        text = text.replace("role: worker}", f"role: worker, {worker}}}")
    return inventory.parse(text, "inv.yaml")


def sh(script: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "HOME": str(home)}
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, timeout=30)


# Inventory keys ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("/var/lib/raycluster", "/var/lib/raycluster"),
        ("/var/lib/raycluster/", "/var/lib/raycluster"),
        ("~/.local/state/raycluster", "~/.local/state/raycluster"),
        ("/srv/ray_state-1.d", "/srv/ray_state-1.d"),
    ],
)
def test_host_state_dir_accepts_absolute_and_home_paths(value: str, expected: str) -> None:
    assert inv(f"host_state_dir: {value}\n").host_state_dir == expected


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("raycluster", "is not a folder path"),
        ("'~rayops/state'", "is not a folder path"),
        ("'$HOME/state'", "is not a folder path"),
        ("'/a b'", "is not a folder path"),
        ("'/etc/ray;rm'", "is not a folder path"),
        ("/", "is not a folder path"),
        ("'~'", "is not a folder path"),
        ("/srv/../etc", "contains '.' or '..'"),
        ("''", "is not a folder path"),
        ("[/a]", "Input should be a valid string"),
    ],
)
def test_a_bad_host_state_dir_is_one_line_naming_the_field_and_its_line(value: str, problem: str) -> None:
    with pytest.raises(InventoryError) as caught:
        inv(f"host_state_dir: {value}\n")
    message = str(caught.value)
    assert message.startswith("inv.yaml:6: host_state_dir: ") and problem in message and "\n" not in message
    assert caught.value.hint


@pytest.mark.parametrize(
    ("extra", "worker", "where"),
    [
        ("ssh: {sudo: 'yes'}\n", "", "inv.yaml:6: ssh.sudo:"),
        ("ssh: {sudo: 1}\n", "", "inv.yaml:6: ssh.sudo:"),
        ("", "ssh: {sudo: on_demand}", "inv.yaml:5: hosts[1].ssh.sudo:"),
    ],
)
def test_ssh_sudo_is_a_strict_boolean(extra: str, worker: str, where: str) -> None:
    with pytest.raises(InventoryError) as caught:
        inv(extra, worker)
    assert str(caught.value).startswith(where) and "valid boolean" in str(caught.value)
    field = where.split(": ")[1].rstrip(":")
    assert caught.value.hint == f"write {field}: true or {field}: false"


def test_the_folder_depends_on_the_login_user_sudo_and_the_key() -> None:
    root = inv()
    assert [folders.cluster_dir(root, h) for h in root.hosts] == ["/etc/raycluster/demo"] * 2
    mixed = inv("ssh: {user: rayops}\n", "ssh: {user: root}")
    assert folders.cluster_dir(mixed, mixed.hosts[0]) == "~/.local/state/raycluster/demo"
    assert folders.cluster_dir(mixed, mixed.hosts[1]) == "/etc/raycluster/demo"
    sudo = inv("ssh: {user: rayops, sudo: true}\n")
    assert folders.cluster_dir(sudo, sudo.hosts[0]) == "/etc/raycluster/demo"
    assert folders.uses_sudo(sudo, sudo.hosts[0])
    assert not folders.uses_sudo(inv("ssh: {sudo: true}\n"), root.hosts[0])  # root needs no sudo
    chosen = inv("ssh: {user: rayops, sudo: true}\nhost_state_dir: ~/rc\n")
    assert folders.cluster_dir(chosen, chosen.hosts[1]) == "~/rc/demo"
    assert not folders.uses_sudo(chosen, chosen.hosts[1])  # a home folder never needs sudo
    assert token_path_on_host(chosen, chosen.hosts[0]) == "~/rc/demo/auth-token"


def test_the_login_user_from_ssh_config_chooses_the_folder_as_the_pool_logs_in(tmp_path: Path) -> None:
    """No ssh.user in the inventory: ~/.ssh/config's User is who logs in, so it decides the default folder."""
    config = tmp_path / "ssh_config"
    config.write_text("Host 192.0.2.12\n  User rayops\n")
    setting = f"ssh: {{config_file: {config}}}\n"
    by_config = inv(setting)
    head, worker = by_config.hosts
    assert folders.login_user(by_config, head) == "root" and folders.login_user(by_config, worker) == "rayops"
    assert folders.cluster_dir(by_config, head) == "/etc/raycluster/demo"
    assert folders.cluster_dir(by_config, worker) == "~/.local/state/raycluster/demo"
    assert folders.archive_dir(by_config, worker) == "/var/tmp/raycluster-images-rayops"
    explicit = inv(setting, "ssh: {user: root}")  # the inventory's own user wins, as for the connection
    assert folders.cluster_dir(explicit, explicit.hosts[1]) == "/etc/raycluster/demo"


# The commands, in a real shell ------------------------------------------------------------------------------


def test_shell_path_expands_only_a_leading_home() -> None:
    assert shell_path("~/.local/state/raycluster/demo") == '"$HOME"/.local/state/raycluster/demo'
    assert shell_path("/etc/raycluster/demo") == "/etc/raycluster/demo"
    assert shell_path("/x/~/y z") == "'/x/~/y z'"


def test_put_writes_the_token_0600_under_the_login_users_home_from_stdin(tmp_path: Path) -> None:
    user = inv("ssh: {user: rayops}\n")
    path = token_path_on_host(user, user.hosts[0])
    command = put_command(path, 0o600)
    assert "s3cret" not in command
    done = subprocess.run(
        ["sh", "-c", command], input="s3cret", capture_output=True, text=True, env={**os.environ, "HOME": str(tmp_path)}
    )
    assert done.returncode == 0, done.stderr
    written = tmp_path / ".local/state/raycluster/demo/auth-token"
    assert written.read_text() == "s3cret" and stat.S_IMODE(written.stat().st_mode) == 0o600
    assert stat.S_IMODE(written.parent.stat().st_mode) == 0o700


def test_put_makes_only_the_files_own_folder_private_and_the_folders_above_it_0755(tmp_path: Path) -> None:
    """As root's `up` under `umask 077`: a shared folder that put makes on the way stays crossable by others."""
    kept = tmp_path / "etc"
    kept.mkdir(mode=0o711)  # an existing folder keeps its mode
    kept.chmod(0o711)
    command = put_command(f"{kept}/raycluster/demo/auth-token", 0o600)
    done = subprocess.run(["sh", "-c", f"umask 077; {command}"], input="s3cret", capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    written = kept / "raycluster/demo/auth-token"
    assert written.read_text() == "s3cret" and stat.S_IMODE(written.stat().st_mode) == 0o600
    assert stat.S_IMODE(written.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((kept / "raycluster").stat().st_mode) == 0o755
    assert stat.S_IMODE(kept.stat().st_mode) == 0o711
    assert [p.name for p in written.parent.iterdir()] == ["auth-token"]  # no temporary file left


def test_make_and_remove_the_folder_without_sudo(tmp_path: Path) -> None:
    user = inv("ssh: {user: rayops}\n")
    host = user.hosts[1]
    assert "sudo" not in folders.make_dir_command(user, host)
    assert sh(folders.make_dir_command(user, host), tmp_path).returncode == 0
    folder = tmp_path / ".local/state/raycluster/demo"
    assert folder.is_dir() and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert sh(folders.make_dir_command(user, host), tmp_path).returncode == 0  # again: no error
    assert sh(folders.remove_dir_command(user, host), tmp_path).stdout == "removed\n" and not folder.exists()
    assert sh(folders.remove_dir_command(user, host), tmp_path).stdout == ""  # nothing there: nothing said


def test_only_the_cluster_folder_is_private_even_under_umask_077(tmp_path: Path) -> None:
    """CI: root's `up` had made /etc/raycluster 0700 (mkdir -p under umask 077), which a sudo login's
    files then could not cross. The folder above the cluster's is 0755 whatever the session's umask."""
    chosen = inv(f"host_state_dir: {tmp_path}/state\n")
    assert sh("umask 077 && " + folders.make_dir_command(chosen, chosen.hosts[0]), tmp_path).returncode == 0
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "state/demo").stat().st_mode) == 0o700


def test_with_sudo_the_folder_is_made_for_the_login_user() -> None:
    sudo = inv("ssh: {user: rayops, sudo: true}\n")
    host = sudo.hosts[0]
    assert folders.make_dir_command(sudo, host) == (
        f"{folders.claim_check(sudo, host)} && "
        "{ [ -x /etc/raycluster ] || sudo -n install -d -m 755 /etc/raycluster; } && "
        'sudo -n install -d -m 700 -o "$(id -un)" -g "$(id -gn)" /etc/raycluster/demo && '
        "{ [ -f /etc/raycluster/demo/.raycluster-cluster ] || "
        "echo 'raycluster cluster demo' > /etc/raycluster/demo/.raycluster-cluster; }"
    )
    assert "sudo -n rm -rf -- /etc/raycluster/demo" in folders.remove_dir_command(sudo, host)


def test_the_container_mounts_the_files_from_the_login_users_home(tmp_path: Path) -> None:
    user = inv("ssh: {user: rayops}\n")
    host = user.hosts[1]
    command = docker_run_command(user, host)
    assert '--volume="$HOME"/.local/state/raycluster/demo/worker.env:/run/raycluster/env:ro' in command
    # What the host's shell hands to docker: the home expanded, one word per argument.
    words = sh("docker() { printf '%s\\n' \"$@\"; }; " + command, tmp_path).stdout.splitlines()
    home = str(tmp_path)
    assert f"--volume={home}/.local/state/raycluster/demo/worker.env:/run/raycluster/env:ro" in words
    assert f"--volume={home}/.local/state/raycluster/demo/auth-token:/run/raycluster/auth-token:ro" in words
    assert env_path_on_host(user, host) == "~/.local/state/raycluster/demo/worker.env"
    root = inv()
    assert "--volume=/etc/raycluster/demo/worker.env:/run/raycluster/env:ro" in docker_run_command(root, root.hosts[1])


def test_the_probe_in_a_real_shell_finds_the_parent_it_would_make_the_folder_in(tmp_path: Path) -> None:
    user = inv("ssh: {user: rayops}\n")
    host = user.hosts[0]
    done = sh(folders.probe_command(user, host), tmp_path)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["dir"] == f"{tmp_path}/.local/state/raycluster/demo"
    assert lines["at"].startswith(f"{tmp_path} ") and lines["writable"] == "yes" and lines["sudo"] == "unused"


# The doctor checks' judgements ------------------------------------------------------------------------------


def ctx_of(inventory_: inventory.Inventory, index: int = 1) -> CheckContext:
    return CheckContext(inventory_, inventory_.hosts[index])


def probe_out(user: str, folder: str, at: str, writable: str, sudo: str = "unused") -> str:
    return f"user {user} 1001\ndir {folder}\nat {at}\nwritable {writable}\nsudo {sudo}\n"


def test_state_dir_ok_when_writable_or_creatable() -> None:
    ctx = ctx_of(inv("ssh: {user: rayops}\n"))
    folder = "/home/rayops/.local/state/raycluster/demo"
    made = access.state_dir(0, probe_out("rayops", folder, "/home/rayops rayops 755 directory", "yes"), "", ctx)
    assert made.status == Status.OK and "can be made (in /home/rayops) by rayops" in made.message
    there = access.state_dir(0, probe_out("rayops", folder, f"{folder} rayops 700 directory", "yes"), "", ctx)
    assert there.status == Status.OK and there.message == f"{folder} writable by rayops"


def test_state_dir_fails_naming_the_owner_and_the_fix() -> None:
    ctx = ctx_of(inv("ssh: {user: rayops}\nhost_state_dir: /etc/raycluster\n"))
    found = access.state_dir(0, probe_out("rayops", "/etc/raycluster/demo", "/etc root 755 directory", "no"), "", ctx)
    assert found.status == Status.FAIL
    assert found.message == "/etc/raycluster/demo cannot be made: /etc is not writable by rayops (root 755)"
    assert "host_state_dir: ~/.local/state/raycluster" in found.hint and "ssh.sudo: true" in found.hint
    assert "on 192.0.2.12: install -d -o rayops -m 700 /etc/raycluster/demo" in found.hint


def test_state_dir_with_sudo_needs_sudo_for_install_and_rm() -> None:
    ctx = ctx_of(inv("ssh: {user: rayops, sudo: true}\n"))
    out = probe_out("rayops", "/etc/raycluster/demo", "/etc root 755 directory", "no", "no")
    denied = access.state_dir(0, out, "", ctx)
    assert denied.status == Status.FAIL and "may not run install and rm through sudo -n" in denied.message
    assert "on 192.0.2.12" in denied.hint and "NOPASSWD: /usr/bin/install, /usr/bin/rm" in denied.hint
    allowed = access.state_dir(0, out.replace("sudo no", "sudo yes"), "", ctx)
    assert allowed.status == Status.OK and "made with sudo -n, owned by rayops" in allowed.message


def test_state_dir_names_a_login_user_other_than_the_inventorys() -> None:
    ctx = ctx_of(inv())  # the inventory says root; ~/.ssh/config made it another user
    out = probe_out("rayops", "/etc/raycluster/demo", "/etc root 755 directory", "no")
    found = access.state_dir(0, out, "", ctx)
    assert found.status == Status.FAIL and "the inventory names root; the host says rayops" in found.message
    assert "set ssh.user: rayops" in found.hint


def test_state_mount_judgements() -> None:
    ctx = ctx_of(inv("ssh: {user: rayops}\n"))
    ok = access.state_mount(0, "path /home/rayops\n", "", ctx)
    assert ok.status == Status.OK and "/home/rayops" in ok.message
    assert access.state_mount(0, "no-image\n", "", ctx).status == Status.SKIP
    err = "docker: Error response from daemon: error while creating mount source path: permission denied."
    bad = access.state_mount(125, "path /home/rayops\n", err, ctx)
    assert (
        bad.status == Status.FAIL and "cannot mount /home/rayops" in bad.message and "permission denied" in bad.message
    )
    assert "192.0.2.12" in bad.hint and "host_state_dir" in bad.hint


def test_docker_access_findings_name_the_fix_for_a_non_root_user() -> None:
    ctx = ctx_of(inv("ssh: {user: rayops}\n"))
    denied = "permission denied while trying to connect to the Docker daemon socket at unix:///var/run/docker.sock"
    found = docker(1, "", denied, ctx)
    assert found.status == Status.FAIL and "user rayops may not use Docker" in found.message
    assert "on 192.0.2.12: usermod -aG docker rayops" in found.hint and "docker.engine: sudo -n docker" in found.hint
    sudo_ctx = ctx_of(inv("ssh: {user: rayops}\n", "docker: {engine: sudo -n docker}"))
    refused = docker(1, "", "sudo: a password is required\n", sudo_ctx)
    assert refused.status == Status.FAIL and "may not run `sudo -n docker` without a password" in refused.message
    assert "rayops ALL=(root) NOPASSWD: /usr/bin/docker" in refused.hint and "usermod -aG docker" in refused.hint


def test_the_image_is_not_called_missing_when_the_engine_refused_the_user() -> None:
    from raycluster_cli.checks.machine import image

    ctx = ctx_of(inv("ssh: {user: rayops}\n"))
    refused = image(1, "", "permission denied while trying to connect to the Docker daemon socket", ctx)
    assert refused.status == Status.SKIP and "see the docker check" in refused.message
    assert image(1, "", "sudo: a password is required", ctx).status == Status.SKIP
    assert image(1, "", "Error: No such image: raycluster/node:0.1.0", ctx).status == Status.FAIL


def test_image_archives_on_a_host_are_the_login_users_own() -> None:
    mixed = inv("ssh: {user: rayops}\n", "ssh: {user: root}")
    assert folders.archive_dir(mixed, mixed.hosts[0]) == "/var/tmp/raycluster-images-rayops"
    assert folders.archive_dir(mixed, mixed.hosts[1]) == "/var/tmp/raycluster-images"
