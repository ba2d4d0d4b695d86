"""Where Podman's CLI answers differently from Docker's: the dialect in engine.py and the checks, parsers and
commands that use it, from output recorded on a lab host with Debian's podman 4.3.1."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from raycluster_cli.checks import Status
from raycluster_cli.checks.base import CheckContext
from raycluster_cli.checks.catalog import DOCKER_VERSION
from raycluster_cli.checks.machine import disk, gpus, gpus_command, image, processes_command, stale_ray, stale_ray_view
from raycluster_cli.config import inventory
from raycluster_cli.host.containers import parse_ps, run_argv
from raycluster_cli.host.engine import DOCKER, PODMAN, adapt_run_argv, dialect_of, image_id, ps_rows
from raycluster_cli.host.engine_facts import engine_command
from raycluster_cli.lab.hosts import LabHost, render_inventory
from raycluster_cli.transport import CommandResult
from raycluster_cli.verbs.status import parse_host

from .conftest import EXAMPLE

RECORDED = Path(__file__).parent / "recorded"
HEX = "a67c20f052d03e0d00682ddd23eb988dc00d388191dd8a156584b2d8f3b6d259"
PODMAN_YAML = EXAMPLE + "docker: {engine: podman}\n"


def _ctx(text: str, index: int = 1) -> CheckContext:
    inv = inventory.parse(text)
    return CheckContext(inv, inv.hosts[index])


@pytest.mark.parametrize(
    ("engine", "dialect"),
    [
        ("podman", PODMAN),
        ("/usr/bin/podman", PODMAN),
        ("sudo -n podman", PODMAN),
        ("docker", DOCKER),
        ("sudo -n docker", DOCKER),
        ("/usr/local/bin/docker", DOCKER),
    ],
)
def test_the_dialect_follows_the_program_of_the_engine(engine: str, dialect: object) -> None:
    assert dialect_of(engine) is dialect


def test_image_ids_of_both_engines_read_the_same() -> None:
    assert image_id(f"sha256:{HEX}\n") == image_id(f"{HEX}\n") == f"sha256:{HEX}"
    assert image_id("") == image_id("Error: nosuch: image not known") == image_id(HEX[:12]) == ""


def test_ps_of_podman_one_json_array_and_of_docker_one_object_a_line_give_the_same_rows() -> None:
    (podman,) = ps_rows((RECORDED / "podman_ps.json").read_text())
    assert podman.id.startswith("4d3a23a38375") and podman.name == "bystander" and podman.state == "running"
    assert podman.labels["io.raycluster.cluster"] == "other" and podman.image == "localhost/raycluster/node:podman"
    docker_line = json.dumps(
        {"ID": podman.id, "Names": "bystander", "State": "running", "Image": podman.image, "Labels": ",".join(
            f"{k}={v}" for k, v in podman.labels.items()
        )}
    )  # fmt: skip
    assert ps_rows(docker_line + "\n\n") == [podman]
    assert parse_ps("") == [] and parse_ps("[]") == []
    (container,) = parse_ps((RECORDED / "podman_ps.json").read_text())
    assert container.running and container.name == "bystander"


def test_podman_takes_gpus_as_cdi_devices() -> None:
    argv = ["docker", "run", "--gpus", "all", "--gpus=2", '--gpus="device=1,3"', "--cpus=1", "img", "--gpus"]
    assert adapt_run_argv(DOCKER, argv) == argv
    assert adapt_run_argv(PODMAN, argv) == [
        "docker", "run", "--device=nvidia.com/gpu=all", "--device=nvidia.com/gpu=0", "--device=nvidia.com/gpu=1",
        "--device=nvidia.com/gpu=1", "--device=nvidia.com/gpu=3", "--cpus=1", "img", "--device=nvidia.com/gpu=all",
    ]  # fmt: skip
    inv = inventory.parse(PODMAN_YAML.replace('["--cpus=0.5"]', '["--cpus=0.5", "--gpus all"]'))
    argv = run_argv(inv, inv.hosts[2])
    assert "--device=nvidia.com/gpu=all" in argv and "--gpus" not in argv


def test_podman_restarts_node_containers_with_always_which_its_boot_service_starts() -> None:
    """Podman has no engine that starts containers at boot; podman-restart.service starts those of `always`."""
    inv = inventory.parse(PODMAN_YAML)
    for host in inv.hosts:
        argv = run_argv(inv, host)
        assert "--restart=always" in argv and "--restart=unless-stopped" not in argv
    docker = inventory.parse(EXAMPLE)
    assert "--restart=unless-stopped" in run_argv(docker, docker.head_host)
    assert adapt_run_argv(PODMAN, ["docker", "run", "--restart=on-failure", "img"])[2] == "--restart=on-failure"


def test_doctor_asks_podman_for_its_version_and_storage_root() -> None:
    """One `docker info` per host carries the version and the storage root (and Docker's runtimes)."""
    assert DOCKER_VERSION.needs[0].command is not None
    podman, docker = engine_command(_ctx(PODMAN_YAML)), engine_command(_ctx(EXAMPLE))
    assert "{{.Version.Version}}{{println}}{{.Store.GraphRoot}}'" in podman and "Runtimes" not in podman
    assert "{{.ServerVersion}}{{println}}{{.DockerRootDir}}{{println}}{{json .Runtimes}}" in docker
    assert podman.count("docker info") == 1 and docker.count("docker info") == 1
    found = disk(0, (RECORDED / "podman_disk.txt").read_text(), "", _ctx(PODMAN_YAML))
    assert found.status == Status.OK and "/var/lib/containers/storage" in found.message, found


def test_a_bare_podman_image_id_is_the_image_present() -> None:
    found = image(0, HEX + "\n", "", _ctx(PODMAN_YAML))
    assert found.status == Status.OK and found.data == {"image_id": f"sha256:{HEX}"}
    assert image(125, "", "Error: image not known", _ctx(PODMAN_YAML)).status == Status.FAIL


def test_stale_ray_places_podmans_containers_from_its_ps_and_the_cgroups() -> None:
    """No engine command of its own: the running containers come from `docker ps -a` (Podman's JSON array,
    labels an object), the Ray processes are placed by their cgroups (`libpod-<id>`)."""
    assert "docker" not in processes_command(_ctx(PODMAN_YAML))
    containers = CommandResult(0, (RECORDED / "podman_ps.json").read_text(), "")
    view = stale_ray_view(_ctx(PODMAN_YAML), [CommandResult(0, "   1 /sbin/init\n---\n", ""), containers])
    assert "== 4d3a23a383759240527219ceac9d3f5159c56d0c69cf04a812ce6fcfa7466c2f bystander other\n" in view.stdout
    # Recorded on a podman lab host: a foreign Ray container, and an idle one labelled for another cluster.
    found = stale_ray(0, (RECORDED / "podman_stale_ray.txt").read_text(), "", _ctx(PODMAN_YAML))
    assert found.status == Status.FAIL and found.data["containers"] == ["foreign"], found
    assert "docker rm -f foreign" in found.hint


def test_podman_gpus_come_from_a_cdi_spec() -> None:
    yaml_text = PODMAN_YAML.replace("role: worker}", "role: worker, num_gpus: 1}", 1)
    assert "/etc/cdi/" in gpus_command(_ctx(yaml_text)) and "Runtimes" not in gpus_command(_ctx(yaml_text))
    smi = "0, NVIDIA H100, 81559 MiB\nrc=0\n---\n"
    missing = gpus(0, smi, "", _ctx(yaml_text))
    assert missing.status == Status.FAIL and "nvidia-ctk cdi generate" in missing.hint
    spec = 'cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: "0"\n'
    ok = gpus(0, smi + spec, "", _ctx(yaml_text))
    assert ok.status == Status.OK and "CDI" in ok.message


def test_status_shows_podmans_image_id_like_dockers() -> None:
    inv = inventory.parse(PODMAN_YAML)
    status = parse_host(inv, inv.head_host, f"running {HEX} demo/head\n--raycluster--\n2.60.0\n")
    assert status.image_id == f"sha256:{HEX}"


def test_a_podman_lab_writes_the_engine_into_its_inventory(tmp_path: Path) -> None:
    hosts = [LabHost("lab-h1", "lab-h1", "192.0.2.11")]
    data = yaml.safe_load(render_inventory(hosts, tmp_path / "k", tmp_path / "kh", "img", {}, "podman"))
    assert data["docker"] == {"shm_size": "1g", "engine": "podman"}
    inv = inventory.parse(yaml.safe_dump(data))
    assert shlex.join(run_argv(inv, inv.head_host)[:2]) == "docker run"
    assert "engine" not in yaml.safe_load(render_inventory(hosts, tmp_path / "k", tmp_path / "kh", "img", {}))["docker"]
