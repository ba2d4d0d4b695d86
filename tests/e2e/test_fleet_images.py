"""Image distribution on the fleet lab: the operator sends one copy, the hosts serve each other over the lab
network (each copy authenticated by a one-time secret), and a host cut off from its peers by iptables gets
the image from the operator. Bytes are counted on the lab bridge, independently of the program."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.delivery import deliver as images
from raycluster_cli.lab import hosts as lab
from raycluster_cli.lab.engines import build_small_image
from raycluster_cli.progress import Event
from raycluster_cli.transport.pool import SSHPool

from .conftest import FLEET_NAME, Lab

pytestmark = [pytest.mark.lab, pytest.mark.fleet]

BASE_IMAGE = os.environ.get("BASE_IMAGE", "raycluster/debian-base:bookworm")
# Small, with python3 (as a node image has): hosts without python3 run the listener inside it.
SMALL = f"raycluster/p2ptest:{FLEET_NAME}"


@pytest.fixture(scope="module")
def small_image() -> str:
    return build_small_image(lab.docker_client(), SMALL, BASE_IMAGE)


def _bridge_tx(network: str) -> int:
    net_id = lab.docker_client().networks.get(network).id
    return int(Path(f"/sys/class/net/br-{net_id[:12]}/statistics/tx_bytes").read_text())


def _part(the_lab: Lab, tmp_path: Path, first: int, count: int) -> tuple[inventory.Inventory, list[lab.LabHost]]:
    hosts = the_lab.info.hosts[first : first + count]

    def edit(data: dict[str, Any]) -> None:
        data["image"] = SMALL
        data["head"] = {"address": hosts[0].address}
        data["hosts"] = [{"address": h.address, "role": "head" if i == 0 else "worker"} for i, h in enumerate(hosts)]

    path = the_lab.variant(tmp_path / f"part{first}.yaml", edit)
    for host in hosts:
        the_lab.sh(host.hostname, f"docker rmi -f {SMALL} >/dev/null 2>&1; rm -rf /var/tmp/raycluster-images; true")
    return inventory.load(path).inventory, hosts


def _distribute(inv: inventory.Inventory, image_id: str, archive_dir: Path) -> list[images.ImageTransfer]:
    def progress(event: Event) -> None:
        if isinstance(event, str):
            print(f"[p2p] {event}", file=sys.stderr)

    plan = [images.ImageTransfer(str(h.address), "missing", "stream") for h in inv.hosts]
    pool = SSHPool(inv)
    try:
        return images.distribute(inv, pool, plan, image_id, archive_dir, progress)
    finally:
        pool.close()


@pytest.fixture
def archive_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "archives"


def test_one_upload_reaches_eight_hosts(fleet_lab: Lab, small_image: str, tmp_path: Path, archive_dir: Path) -> None:
    inv, hosts = _part(fleet_lab, tmp_path, 0, 8)
    images._archive(SMALL, small_image, "zstd", archive_dir, lambda _: None)  # compress before counting
    size = next(archive_dir.glob("*.tar.*")).stat().st_size
    before = _bridge_tx(fleet_lab.info.network)
    done = _distribute(inv, small_image, archive_dir)
    sent = _bridge_tx(fleet_lab.info.network) - before
    assert sorted(t.host for t in done) == sorted(h.address for h in hosts)
    assert [t.source for t in done].count("operator") == 1
    sources = {t.host: t.source for t in done}
    assert all(t.source in {h.address for h in hosts} for t in done if t.source != "operator"), sources
    assert sent < 1.5 * size, f"the operator sent {sent} bytes for a {size}-byte archive"
    for host in hosts:
        found = fleet_lab.sh(host.hostname, f"docker image inspect --format '{{{{.Id}}}}' {SMALL}").strip()
        assert found == small_image
        assert fleet_lab.sh(host.hostname, "ls -A /var/tmp/raycluster-images 2>/dev/null; true").strip() == ""


def test_a_host_cut_off_from_its_peers_gets_the_image_from_the_operator(
    fleet_lab: Lab, small_image: str, tmp_path: Path, archive_dir: Path
) -> None:
    inv, hosts = _part(fleet_lab, tmp_path, 8, 3)
    cut = hosts[-1]
    peers = " ".join(h.address for h in hosts[:-1])
    rules = "; ".join(
        f"iptables {{op}} INPUT -s {a} -j DROP; iptables {{op}} OUTPUT -d {a} -j DROP" for a in peers.split()
    )
    fleet_lab.sh(cut.hostname, rules.format(op="-A"))
    try:
        done = {t.host: t for t in _distribute(inv, small_image, archive_dir)}
    finally:
        fleet_lab.sh(cut.hostname, rules.format(op="-D"))
    assert done[cut.address].source.startswith("operator (after a peer copy failed: ")
    assert [t.source for t in done.values()].count("operator") == 1
    found = fleet_lab.sh(cut.hostname, f"docker image inspect --format '{{{{.Id}}}}' {SMALL}").strip()
    assert found == small_image
