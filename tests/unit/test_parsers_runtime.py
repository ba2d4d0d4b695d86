"""Parsers behind the runtime checks, from recorded output (lab hosts, GPU servers, odd cases)."""

from pathlib import Path

import pytest

from raycluster_cli.checks.parsers_machine import (
    is_ray_process,
    parse_df,
    parse_docker_size,
    parse_meminfo,
    parse_nvidia_smi,
    parse_ray_processes,
    parse_runtimes,
    parse_versions,
)

RECORDED = Path(__file__).parent / "recorded"


@pytest.mark.parametrize(
    ("text", "size"),
    [("2g", 2 * 1024**3), ("512m", 512 * 1024**2), ("1.5G", int(1.5 * 1024**3)), ("100", 100), ("64mb", 64 * 1024**2)],
)
def test_docker_sizes(text: str, size: int) -> None:
    assert parse_docker_size(text) == size


def test_docker_size_garbage() -> None:
    assert parse_docker_size("lots") is None


def test_meminfo_in_bytes() -> None:
    mem = parse_meminfo((RECORDED / "meminfo_lab.txt").read_text())
    assert mem["MemTotal"] > mem["MemAvailable"] > 0
    assert mem["MemTotal"] % 1024 == 0
    assert "HugePages_Total" in mem  # a field without a unit stays a count


def test_df_two_paths_and_a_wrapped_device_name() -> None:
    lab = parse_df((RECORDED / "disk_lab.txt").read_text().split("---\n")[1], ["/var/lib/docker", "/tmp"])
    assert [(r.path, r.mount) for r in lab] == [("/var/lib/docker", "/var/lib/docker"), ("/tmp", "/")]
    assert lab[0].available == 59558576128
    wrapped = (
        "Filesystem 1-blocks Used Available Capacity Mounted on\n"
        "/dev/mapper/vg--data-docker--very--long--name\n"
        "    1000000 900000 100000 90% /var/lib/docker\n"
    )
    assert parse_df(wrapped, ["/var/lib/docker"])[0].available == 100000
    assert parse_df("df: /nope: No such file or directory\n", ["/nope"]) == []


def test_nvidia_smi_eight_gpus_and_no_driver() -> None:
    gpus = parse_nvidia_smi((RECORDED / "nvidia_smi_8gpu.csv").read_text())
    assert len(gpus) == 8 and gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert parse_nvidia_smi((RECORDED / "nvidia_smi_no_driver.txt").read_text()) == []


def test_docker_runtimes() -> None:
    assert "nvidia" in parse_runtimes((RECORDED / "docker_runtimes_nvidia.json").read_text())
    assert parse_runtimes('{"io.containerd.runc.v2":{"path":"runc"},"runc":{"path":"runc"}}') == {
        "io.containerd.runc.v2",
        "runc",
    }
    assert parse_runtimes("") == set()


def test_versions_inside_the_image() -> None:
    assert parse_versions("python 3.11.2\nray 2.60.0\n") == {"python": "3.11.2", "ray": "2.60.0"}
    assert parse_versions("Traceback (most recent call last):\nModuleNotFoundError: ray\n") == {}


@pytest.mark.parametrize(
    "args",
    [
        "/opt/ray/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x",
        "/usr/lib/python3/dist-packages/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp",
        "ray::IDLE",
        "ray::Stage.forward",
    ],
)
def test_ray_processes(args: str) -> None:
    assert is_ray_process(args)


@pytest.mark.parametrize(
    "args",
    ["/opt/ray/bin/python3 /opt/ray/bin/ray start --block", "vim raylet.cc", "grep raylet", "sshd: /usr/sbin/sshd"],
)
def test_not_ray_processes(args: str) -> None:
    assert not is_ray_process(args)


def test_our_containers_ray_is_placed_in_it() -> None:
    ps, tops = (RECORDED / "stale_ray_ours_h2.txt").read_text().split("---\n", 1)
    found = parse_ray_processes(ps, tops)
    assert found and all(p.container_cluster == "lab" for p in found)
    assert {p.container_name for p in found} == {"raycluster-lab-worker"}


def test_foreign_container_next_to_ours() -> None:
    ps, tops = (RECORDED / "stale_ray_foreign_h2.txt").read_text().split("---\n", 1)
    found = parse_ray_processes(ps, tops)
    foreign = [p for p in found if p.container_cluster != "lab"]
    assert [(p.pid, p.container_name) for p in foreign] == [(2093, "foreign-ray")]
    assert any(p.container_cluster == "lab" and "raylet" in p.command for p in found)


def test_ray_on_the_host_itself() -> None:
    ps = "  4242 /home/u/.venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --x\n   1 /sbin/init\n"
    found = parse_ray_processes(ps, "")
    assert [(p.pid, p.container_id) for p in found] == [(4242, "")]


def test_a_process_docker_top_missed_is_placed_by_its_cgroup_or_dropped_when_gone() -> None:
    ps, tops, cgroups = (RECORDED / "stale_ray_ours_cgroups_h2.txt").read_text().split("---\n")
    found = parse_ray_processes(ps, tops, cgroups)
    assert found and {p.container_cluster for p in found} == {"lab"}
    raylet = next(p for p in found if "raylet" in p.command)
    # A worker started between `ps` and `docker top`: only its cgroup tells where it lives.
    racy_tops = "\n".join(line for line in tops.splitlines() if line.strip() != str(raylet.pid)) + "\n"
    assert all(p.container_cluster == "lab" for p in parse_ray_processes(ps, racy_tops, cgroups))
    assert any(p.container_cluster == "" for p in parse_ray_processes(ps, racy_tops, ""))
    # A short-lived worker that exited before the second look is not reported at all.
    ps_with_ghost = ps + "  9999 ray::IDLE\n"
    assert 9999 not in {p.pid for p in parse_ray_processes(ps_with_ghost, tops, cgroups + "9999 gone\n")}
    assert 9999 in {p.pid for p in parse_ray_processes(ps_with_ghost, tops, cgroups)}
