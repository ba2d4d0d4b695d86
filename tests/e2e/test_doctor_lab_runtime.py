"""doctor's runtime checks on the real lab: Ray inside the image, /dev/shm and memory against the object store,
GPUs asked where there are none, a foreign Ray on a host, and our own running cluster (never reported)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from raycluster_cli.lab import hosts as lab

from .conftest import IP1, IP2, IP3, Lab
from .findings import failed, finding, problems, warned

pytestmark = pytest.mark.lab
IMAGE = lab.NODE_IMAGE
STASH = IMAGE.rsplit(":", 1)[0] + ":stash"


def test_ray_version_in_the_image_differs_on_one_host(lab_hosts: Lab) -> None:
    # Same image name on lab-h2, but its Ray says it is 2.9.3: what `pip install ray` in a Dockerfile can do.
    metadata = "/opt/ray/lib/python3.11/site-packages/ray-2.60.0.dist-info/METADATA"
    dockerfile = f"FROM {IMAGE}\nRUN sed -i 's/^Version: 2.60.0$/Version: 2.9.3/' {metadata}\n"
    lab_hosts.sh("lab-h2", f"docker tag {IMAGE} {STASH}")
    try:
        lab_hosts.sh("lab-h2", f"DOCKER_BUILDKIT=0 docker build -q -t {IMAGE} - <<'EOF'\n{dockerfile}EOF")
        code, doc, _ = lab_hosts.cli("doctor")
        assert code == 1
        assert failed(doc) == [(IP2, "image-runtime"), (IP2, "image-same")], problems(doc)
        bad = finding(doc, IP2, "image-runtime")
        assert "has Ray 2.9.3, the CLI expects 2.60.0" in bad["message"]
        assert "ray[default]==2.60.0" in bad["hint"]
    finally:
        lab_hosts.sh("lab-h2", f"docker tag {STASH} {IMAGE} && docker rmi {STASH} && docker image prune -f")


def test_small_shm_warns_and_a_huge_object_store_fails_memory(lab_hosts: Lab, tmp_path: Path) -> None:
    def small_shm(data: dict[str, Any]) -> None:
        data["hosts"][2]["docker"] = {"shm_size": "64m"}  # lab-h3 only; the object store stays 300 MB

    code, doc, _ = lab_hosts.cli("doctor", inventory=lab_hosts.variant(tmp_path / "shm.yaml", small_shm))
    assert code == 0, failed(doc)
    assert warned(doc) == [(IP3, "shm")]
    shm = finding(doc, IP3, "shm")
    assert "/dev/shm of the container (0.1 GiB, docker.shm_size)" in shm["message"]
    assert "docker.shm_size: 1g" in shm["hint"] and "--shm-size=1g" in shm["hint"]

    def huge_store(data: dict[str, Any]) -> None:
        data["ray"]["object_store_memory"] = 64 * 1024**4  # 64 TiB: no lab host has that

    code, doc, _ = lab_hosts.cli("doctor", inventory=lab_hosts.variant(tmp_path / "mem.yaml", huge_store))
    assert code == 1
    assert failed(doc) == [(ip, "memory") for ip in (IP1, IP2, IP3)]
    assert "less than ray.object_store_memory (65536.0 GiB)" in finding(doc, IP1, "memory")["message"]


def test_gpus_asked_on_a_host_without_any(lab_hosts: Lab, tmp_path: Path) -> None:
    def one_gpu(data: dict[str, Any]) -> None:
        data["hosts"][1]["num_gpus"] = 1

    code, doc, _ = lab_hosts.cli("doctor", inventory=lab_hosts.variant(tmp_path / "gpu.yaml", one_gpu))
    assert code == 1
    assert failed(doc) == [(IP2, "gpus")]
    bad = finding(doc, IP2, "gpus")
    assert "num_gpus: 1 but nvidia-smi is not installed" in bad["message"]
    assert "NVIDIA driver" in bad["hint"]
    assert not any(c["id"] == "gpus" and c["host"] != IP2 for c in doc["checks"])


def test_foreign_ray_then_our_own_cluster(lab_hosts: Lab) -> None:
    """A `ray start --head` container that is not ours is flagged; our own running cluster never is."""
    foreign = (
        f"docker run -d --name foreign-ray --network host {IMAGE} ray start --head --port=6390 "
        "--dashboard-port=8266 --ray-client-server-port=20091 --include-dashboard=false --num-cpus=1 "
        "--object-store-memory=80000000 --block"
    )
    lab_hosts.sh("lab-h3", foreign)
    try:
        lab_hosts.sh(
            "lab-h3",
            "for i in $(seq 300); do docker top foreign-ray -eo pid,args | grep -q gcs_server && exit 0; "
            "sleep 0.2; done; docker logs --tail 5 foreign-ray; exit 1",
        )
        code, doc, _ = lab_hosts.cli("doctor")
        assert code == 1
        assert failed(doc) == [(IP3, "stale-ray")]
        bad = finding(doc, IP3, "stale-ray")
        assert "foreign-ray" in bad["message"] and "docker rm -f foreign-ray" in bad["hint"]
    finally:
        lab_hosts.sh("lab-h3", "docker rm -f foreign-ray")

    code, doc, err = lab_hosts.cli("up")
    assert code == 0, err
    try:
        code, doc, _ = lab_hosts.cli("doctor")
        assert code == 0, failed(doc)
        assert failed(doc) == []
        assert finding(doc, IP1, "ports-free")["message"] == "Ray ports are held by this cluster's running head"
        for host in (IP1, IP2, IP3):
            assert finding(doc, host, "stale-ray")["status"] == "ok"
            assert finding(doc, host, "worker-ports")["status"] == "ok"
    finally:
        lab_hosts.cli("down")
