"""Fact commands whose shell text does work itself (builtins instead of processes), run under a real /bin/sh
and bash: what they print must be what the processes they replace printed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from raycluster_cli.checks.hostnet import ETC_HOSTS_COMMAND
from raycluster_cli.checks.machine import processes_command
from raycluster_cli.host.folders import _nearest_existing

SHELLS = ["/bin/sh", "bash"]


def sh(shell: str, command: str, cwd: Path | None = None) -> str:
    done = subprocess.run([shell, "-c", command], capture_output=True, text=True, timeout=30, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("shell", SHELLS)
def test_processes_lists_ray_then_each_ones_cgroup_from_one_awk(shell: str, tmp_path: Path) -> None:
    raylet = tmp_path / "raylet"
    shutil.copy("/bin/sleep", raylet)
    process = subprocess.Popen([str(raylet), "30"])
    try:
        ps_text, cgroups = sh(shell, processes_command(None)).split("---\n")  # type: ignore[arg-type]
        cgroup = Path(f"/proc/{process.pid}/cgroup").read_text()
    finally:
        process.kill()
        process.wait()
    # Its own line among the Ray processes listed (a lab's Ray nodes on this machine are listed too)
    assert any(f"{process.pid} {raylet} 30" in line for line in ps_text.splitlines()[:-1]), ps_text
    assert ps_text.splitlines()[-1].startswith("# ") and ps_text.splitlines()[-1].endswith(" processes")
    assert f"{process.pid} " + cgroup.replace("\n", " ") + "\n" in cgroups  # as `tr '\n' ' '` printed it


@pytest.mark.parametrize("shell", SHELLS)
def test_the_nearest_existing_folder_without_dirname(shell: str, tmp_path: Path) -> None:
    def nearest(folder: str) -> str:
        return sh(shell, _nearest_existing(folder) + 'echo "$p"', cwd=tmp_path).strip()

    assert nearest(str(tmp_path / "a" / "b" / "c")) == str(tmp_path)
    assert nearest(str(tmp_path)) == str(tmp_path)
    assert nearest("/nonexistent-raycluster-test/x") == "/"
    assert nearest("x/y") == "."  # relative: the working folder


@pytest.mark.parametrize("shell", SHELLS)
def test_etc_hosts_reads_the_name_hostname_prints(shell: str) -> None:
    name, _, hosts = sh(shell, ETC_HOSTS_COMMAND).partition("---\n")
    assert name == subprocess.run(["hostname"], capture_output=True, text=True).stdout
    assert hosts == Path("/etc/hosts").read_text()
