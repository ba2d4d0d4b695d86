"""Break one lab host at a time, run `doctor`, expect the right check to fail on the right host, repair."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from raycluster_cli.lab import hosts as lab

from .conftest import IP1, IP2, IP3, UNUSED_IP, Lab
from .findings import failed, finding

pytestmark = pytest.mark.lab
IMAGE = lab.NODE_IMAGE  # what the lab loaded into every lab host and wrote into the inventory
STASH = IMAGE.rsplit(":", 1)[0] + ":stash"


@pytest.fixture
def hosts_file(lab_hosts: Lab) -> Iterator[Lab]:
    """Lets a test rewrite lab-h3's /etc/hosts; puts the original back afterwards."""
    original = lab_hosts.sh("lab-h3", "cat /etc/hosts")
    yield lab_hosts
    lab_hosts.sh("lab-h3", f"cat > /etc/hosts <<'EOF'\n{original}EOF")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("127.0.0.1 localhost\n", "does not name lab-h3"),
        (f"127.0.0.1 localhost\n{UNUSED_IP} lab-h3\n", f"maps lab-h3 to {UNUSED_IP}, not {IP3}"),
    ],
    ids=["hostname-missing", "hostname-wrong-ip"],
)
def test_etc_hosts_broken(hosts_file: Lab, content: str, expected: str) -> None:
    hosts_file.sh("lab-h3", f"printf '{content}' > /etc/hosts")
    code, doc, _ = hosts_file.cli("doctor")
    assert code == 1
    assert failed(doc) == [(IP3, "etc-hosts")]
    bad = finding(doc, IP3, "etc-hosts")
    assert expected in bad["message"]
    assert f"{IP3} lab-h3" in bad["hint"]


def test_container_hostname_differs_from_hosts_entry(lab_hosts: Lab, tmp_path: Path) -> None:
    def rename(data: dict[str, Any]) -> None:
        data["hosts"][1]["hostname"] = "ray-worker-2"

    code, doc, _ = lab_hosts.cli("doctor", inventory=lab_hosts.variant(tmp_path / "inv.yaml", rename))
    assert code == 1
    assert failed(doc) == [(IP2, "etc-hosts")]
    assert "does not name ray-worker-2" in finding(doc, IP2, "etc-hosts")["message"]


def test_head_address_not_on_head(lab_hosts: Lab, tmp_path: Path) -> None:
    def elsewhere(data: dict[str, Any]) -> None:
        data["head"]["address"] = UNUSED_IP  # in the lab subnet, on no host: never answers

    code, doc, _ = lab_hosts.cli("doctor", inventory=lab_hosts.variant(tmp_path / "inv.yaml", elsewhere))
    assert code == 1
    assert (IP1, "head-address") in failed(doc)
    bad = finding(doc, IP1, "head-address")
    assert f"{IP1} (eth0)" in bad["message"] and bad["hint"]


def test_port_taken_on_head(lab_hosts: Lab) -> None:
    squatter = f"docker run -d --name squatter --network host {IMAGE} python -m http.server 6379"
    lab_hosts.sh("lab-h1", squatter)
    try:
        lab_hosts.sh("lab-h1", "for i in $(seq 50); do ss -ltnH | grep -q ':6379 ' && exit 0; sleep 0.2; done; exit 1")
        code, doc, _ = lab_hosts.cli("doctor")
        assert code == 1
        assert failed(doc) == [(IP1, "ports-free")]
        assert "6379" in finding(doc, IP1, "ports-free")["message"]
    finally:
        lab_hosts.sh("lab-h1", "docker rm -f squatter")


def test_docker_daemon_stopped(lab_hosts: Lab) -> None:
    lab_hosts.sh("lab-h2", "pkill -x dockerd; while pgrep -x dockerd >/dev/null; do sleep 0.2; done")
    try:
        code, doc, _ = lab_hosts.cli("doctor")
        assert code == 1
        assert (IP2, "docker") in failed(doc)
        assert "systemctl start docker" in finding(doc, IP2, "docker")["hint"]
    finally:
        lab_hosts.start_engine("lab-h2")


def test_docker_root_full_and_the_image_does_not_fit(lab_hosts: Lab) -> None:
    """lab-h3's engine restarted with its data root on a 64 MiB volume (a tmpfs over /var/lib/docker): the engine
    answers, but containers need at least 1 GiB there and the node image (2 GiB on the other hosts) is missing and
    does not fit: `disk` and `image-fits` fail on lab-h3 with the free bytes, nothing fails elsewhere."""
    stop = "pkill -x dockerd; while pgrep -x dockerd >/dev/null; do sleep 0.2; done"
    lab_hosts.sh("lab-h3", f"{stop}; mount -t tmpfs -o size=64m raycluster-full /var/lib/docker")
    try:
        lab_hosts.start_engine("lab-h3")
        code, doc, _ = lab_hosts.cli("doctor")
        assert code == 1
        assert sorted(failed(doc)) == [(IP3, "disk"), (IP3, "image"), (IP3, "image-fits")], failed(doc)
        disk = finding(doc, IP3, "disk")
        assert disk["data"]["docker_root_free_bytes"] <= 64 * 1024**2, disk
        assert "free for Docker (/var/lib/docker)" in disk["message"] and "docker system prune" in disk["hint"]
        fits = finding(doc, IP3, "image-fits")
        assert fits["data"]["image_bytes"] > 1024**3 > fits["data"]["docker_root_free_bytes"], fits
        assert "is missing here and only 0.1 GiB are free for Docker" in fits["message"], fits
    finally:
        lab_hosts.sh("lab-h3", f"{stop}; umount /var/lib/docker")
        lab_hosts.start_engine("lab-h3")
    lab_hosts.sh("lab-h3", f"docker image inspect {IMAGE} >/dev/null")  # the engine's own data is back


def test_image_missing_on_one_host(lab_hosts: Lab) -> None:
    lab_hosts.sh("lab-h3", f"docker tag {IMAGE} {STASH} && docker rmi {IMAGE}")
    try:
        code, doc, _ = lab_hosts.cli("doctor")
        assert code == 1
        assert failed(doc) == [(IP3, "image")]
        assert "docker load" in finding(doc, IP3, "image")["hint"]
    finally:
        lab_hosts.sh("lab-h3", f"docker tag {STASH} {IMAGE} && docker rmi {STASH}")


def test_image_differs_on_one_host(lab_hosts: Lab) -> None:
    rebuild = (
        f"docker tag {IMAGE} {STASH} && "
        f"printf 'FROM {IMAGE}\\nLABEL changed=yes\\n' | DOCKER_BUILDKIT=0 docker build -q -t {IMAGE} -"
    )
    lab_hosts.sh("lab-h2", rebuild)
    try:
        code, doc, _ = lab_hosts.cli("doctor")
        assert code == 1
        assert failed(doc) == [(IP2, "image-same")]
    finally:
        lab_hosts.sh("lab-h2", f"docker tag {STASH} {IMAGE} && docker rmi {STASH} && docker image prune -f")


def test_wrong_ssh_key(lab_hosts: Lab, tmp_path: Path) -> None:
    key = tmp_path / "other_key"
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    key.write_bytes(pem)
    key.chmod(0o600)

    def other_key(data: dict[str, Any]) -> None:
        data["ssh"]["key"] = str(key)

    code, doc, _ = lab_hosts.cli("doctor", inventory=lab_hosts.variant(tmp_path / "inv.yaml", other_key))
    assert code == 1
    assert failed(doc) == [(h.address, "ssh") for h in lab_hosts.info.hosts]
    bad = finding(doc, IP1, "ssh")
    assert "authentication failed" in bad["message"] and "authorized_keys" in bad["hint"]


def test_unknown_host_key_strict_then_accept_new(lab_hosts: Lab, tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"

    def empty_known_hosts(mode: str) -> Any:
        def edit(data: dict[str, Any]) -> None:
            data["ssh"]["known_hosts_file"] = str(known)
            data["ssh"]["known_hosts"] = mode

        return edit

    code, doc, _ = lab_hosts.cli(
        "doctor", inventory=lab_hosts.variant(tmp_path / "s.yaml", empty_known_hosts("strict"))
    )
    assert code == 1
    assert failed(doc) == [(h.address, "ssh") for h in lab_hosts.info.hosts]
    assert "ssh-keyscan" in finding(doc, IP2, "ssh")["hint"]
    assert not known.exists()

    inv = lab_hosts.variant(tmp_path / "a.yaml", empty_known_hosts("accept-new"))
    code, doc, _ = lab_hosts.cli("doctor", inventory=inv)
    assert code == 0, failed(doc)
    recorded = known.read_text()
    assert all(h.address in recorded for h in lab_hosts.info.hosts)

    # A changed key is refused even under accept-new: record lab-h1's key for lab-h2.
    keys = {line.split()[0]: line.split(maxsplit=1)[1] for line in recorded.splitlines() if line.strip()}
    h1, h2 = lab_hosts.info.hosts[0].address, lab_hosts.info.hosts[1].address
    keys[h2] = keys[h1]
    known.write_text("".join(f"{host} {key}\n" for host, key in keys.items()))
    code, doc, _ = lab_hosts.cli("doctor", inventory=inv)
    assert code == 1
    assert failed(doc) == [(h2, "ssh")]
    assert "CHANGED" in finding(doc, h2, "ssh")["message"]
    assert "ssh-keygen" in finding(doc, h2, "ssh")["hint"]
