"""Models through the relay on the real 3-host lab (issue 30, items 1 and 2): a checkpoint the test writes on this
machine reaches the 3 hosts that lack it with one upload from here, then host to host (bytes counted on the lab
bridge, independently of the program); a second run sends nothing; `status` lists it on every host; `down --purge`
removes the cache and the staging folder (and `up` then relays the image again, verified before each load). A
changed shard of a held model is all that travels (bridge bytes about its size), and each host's new folder is the
operator's, file for file, the unchanged files linked to the old model's. A
host whose received bytes are flipped (a `cat` that corrupts what it writes into the staging folder, on that host
only) never stores the model, and the run stops naming it; a host with a staging folder another user planted is
refused by name and never uses what was planted there."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.delivery import model_relay, models
from raycluster_cli.host.folders import ARCHIVE_DIR
from raycluster_cli.lab import hosts as lab
from raycluster_cli.transport.pool import SSHPool

from ..bench_checkpoints import write_random_gpt2
from .conftest import IP1, IP2, IP3, Lab

pytestmark = [pytest.mark.lab, pytest.mark.slow]

PADDING = 48 << 20  # random bytes beside the weights: the relay's figures are about the bulk
BENCH = (
    "--requests=8",
    "--prompt-len=8",
    "--max-new-tokens=8",
    "--micro-batch=2",
    "--no-references",
    "--calibration-repeats=2",
    "--no-network-check",
)
CACHE = "/etc/raycluster/lab/models"  # the lab logs in as root: the default host state folder


def _bridge_tx(the_lab: Lab) -> int:
    net_id = lab.docker_client().networks.get(the_lab.info.network).id
    return int(Path(f"/sys/class/net/br-{net_id[:12]}/statistics/tx_bytes").read_text())


def _checkpoint(folder: Path) -> models.ModelFolder:
    """A tiny GPT-2 and a padding file of this run's own: no host holds this model yet."""
    write_random_gpt2(folder, layers=6, d_model=64, heads=4, vocab=256, positions=64)
    (folder / "padding.bin").write_bytes(uuid.uuid4().bytes + os.urandom(PADDING))
    return models.read_model_folder(folder)


def _held(the_lab: Lab, hostname: str) -> set[str]:
    return {line.split("\t")[0] for line in the_lab.sh(hostname, f"ls {CACHE} 2>/dev/null; true").split()}


@pytest.fixture(scope="module")
def cluster(lab_hosts: Lab) -> Iterator[Lab]:
    code, _, err = lab_hosts.cli("up", timeout=1500)
    assert code == 0, err[-3000:]
    yield lab_hosts


def test_a_model_is_relayed_once_then_held_and_listed(cluster: Lab, tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "tiny-gpt2-relay")
    before = _bridge_tx(cluster)
    code, doc, err = cluster.cli("bench", f"--model-path={model.root}", *BENCH, timeout=1500)
    first = _bridge_tx(cluster) - before
    assert code == 0, err[-3000:]
    copies = {c["host"]: c for c in doc["model_copies"]}
    assert {h: c["action"] for h, c in copies.items()} == {IP1: "sent", IP2: "sent", IP3: "sent"}
    sources = sorted(c["source"] for c in copies.values())
    assert sources.count("operator") == 1 and all(s in copies for s in sources if s != "operator"), sources
    assert doc["config"]["model_source"] == f"gpt2:/run/raycluster/models/{model.digest}" and doc["completed"] == 8
    ratio = first / model.tar_size
    print(f"[relay] first run: {first} bridge bytes, {ratio:.3f} copies of {model.tar_size}", flush=True)
    assert ratio <= 1.3  # each host its own copy from here: 3 copies

    before = _bridge_tx(cluster)
    code, doc, err = cluster.cli("bench", f"--model-path={model.root}", *BENCH, timeout=1500)
    again = _bridge_tx(cluster) - before
    assert code == 0, err[-3000:]
    assert [c["action"] for c in doc["model_copies"]] == ["held"] * 3
    print(f"[relay] second run: {again} bridge bytes, {again / model.tar_size:.4f} copies", flush=True)
    assert again <= 0.05 * model.tar_size

    code, status, err = cluster.cli("status")
    for host in status["hosts"]:
        mine = [m for m in host["models"] if m["digest"] == model.digest]
        assert mine == [{"digest": model.digest, "size": model.size, "name": "tiny-gpt2-relay"}], host
    for hostname in ("lab-h1", "lab-h2", "lab-h3"):  # the staged tar was removed after the relay
        assert cluster.sh(hostname, f"ls -A {ARCHIVE_DIR}").split() == []


SHARDS = 4  # beside the weights: a checkpoint of several shards, one of which changes


def _sums_on(cluster: Lab, hostname: str, digest: str) -> dict[str, str]:
    listing = cluster.sh(
        hostname, f"cd {CACHE}/{digest} && find . -type f ! -name '.raycluster*' -exec sha256sum {{}} +"
    )
    return {line.split("  ", 1)[1][2:]: line.split("  ", 1)[0] for line in listing.splitlines()}


def test_a_changed_shard_copies_only_that_shard_and_the_hosts_folders_are_the_operators(
    cluster: Lab, tmp_path: Path
) -> None:
    folder = tmp_path / "tiny-sharded"
    write_random_gpt2(folder, layers=6, d_model=64, heads=4, vocab=256, positions=64)
    for index in range(SHARDS):
        (folder / f"extra-{index}-of-{SHARDS}.bin").write_bytes(uuid.uuid4().bytes + os.urandom(PADDING // SHARDS))
    inv = inventory.load(cluster.inventory).inventory
    pool = SSHPool(inv)
    try:  # the first version: the whole tar, through the relay (as the test above measures it)
        _, first, copies = model_relay.place_model(inv, pool, str(folder))
    finally:
        pool.close()
    assert first is not None and {c.files_sent + c.files_reused for c in copies} == {len(first.files)}
    assert all(c.files_sent >= SHARDS for c in copies)  # the shards are new (the weights may be the test's above)

    changed = folder / f"extra-1-of-{SHARDS}.bin"
    changed.write_bytes(uuid.uuid4().bytes + os.urandom(PADDING // SHARDS))
    model = models.read_model_folder(folder)
    before = _bridge_tx(cluster)
    code, doc, err = cluster.cli("bench", f"--model-path={folder}", *BENCH, timeout=1500)
    again = _bridge_tx(cluster) - before
    assert code == 0, err[-3000:]
    assert doc["config"]["model_source"] == f"gpt2:/run/raycluster/models/{model.digest}" and doc["completed"] == 8
    size = changed.stat().st_size
    print(
        f"[relay] changed 1 of {len(model.files)} files ({size} bytes): {again} bridge bytes, "
        f"{again / size:.3f} of the changed file, {again / model.tar_size:.3f} of the model's tar",
        flush=True,
    )
    for copy in doc["model_copies"]:
        assert (copy["action"], copy["files_sent"], copy["files_reused"]) == ("sent", 1, len(model.files) - 1), copy
        assert size < copy["bytes_sent"] < size + 64 * 1024, copy  # the shard, its header and the manifest
    assert 0.95 * size < again < 1.3 * size  # one upload of the changed shard, the rest host to host
    operator = {f.path: f.sha256 for f in model.files}
    for hostname in ("lab-h1", "lab-h2", "lab-h3"):
        assert _sums_on(cluster, hostname, model.digest) == operator, hostname
        assert _sums_on(cluster, hostname, first.digest) == {f.path: f.sha256 for f in first.files}  # untouched
        links = cluster.sh(hostname, f"stat -c %h {CACHE}/{model.digest}/extra-0-of-{SHARDS}.bin").strip()
        assert links == "2", hostname  # the unchanged shard is the old model's file, linked


# A `cat` that flips one byte of what it writes into the relay's staging folder, on one host: what arrives there is
# corrupt, whoever sent it (the operator or a peer), as a bad NIC or disk would make it.
FLIPPING_CAT = """#!/bin/bash
case "$(readlink /proc/$$/fd/1 2>/dev/null)" in
*/raycluster-images/*.part) { head -c 100000; head -c 1 >/dev/null; printf 'Z'; exec /usr/bin/cat; } ;;
*) exec /usr/bin/cat "$@" ;;
esac
"""


def _bench_fails(cluster: Lab, model: models.ModelFolder) -> tuple[int, dict[str, Any]]:
    code, doc, _ = cluster.cli("bench", f"--model-path={model.root}", *BENCH, timeout=900)
    return code, doc


def test_a_host_whose_bytes_arrive_corrupt_never_stores_them_and_is_named(cluster: Lab, tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "tiny-corrupt")
    with cluster.shim("lab-h3", "cat", FLIPPING_CAT):
        code, doc = _bench_fails(cluster, model)
        assert code == 1, doc
        message = doc["error"]["message"]
        assert f"{IP3}: " in message and "arrived corrupt and was not used" in message, message
        assert model.digest not in _held(cluster, "lab-h3")
        assert not cluster.sh("lab-h3", f"ls -A {ARCHIVE_DIR} 2>/dev/null; true").strip()  # no .part left
    # the other hosts were served (and verified) all the same
    assert model.digest in _held(cluster, "lab-h1") and model.digest in _held(cluster, "lab-h2")


def test_a_foreign_staging_folder_is_refused_and_never_used(cluster: Lab, tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "tiny-planted")
    planted = f"{ARCHIVE_DIR}/model-{model.digest}.tar"
    cluster.sh(
        "lab-h2",
        f"rm -rf {ARCHIVE_DIR} && mkdir -m 777 {ARCHIVE_DIR} && echo planted > {planted} && "
        f"chown -R 65534:65534 {ARCHIVE_DIR}",
    )
    try:
        code, doc = _bench_fails(cluster, model)
        assert code == 1, doc
        message = doc["error"]["message"]
        assert f"{IP2}: " in message and f"{ARCHIVE_DIR} on " in message and "belongs to nobody" in message, message
        assert model.digest not in _held(cluster, "lab-h2")
        assert cluster.sh("lab-h2", f"cat {planted}").strip() == "planted"  # untouched, unused
    finally:  # the folder raycluster would have made (the next test purges it)
        cluster.sh("lab-h2", f"rm -rf {ARCHIVE_DIR} && mkdir -m 700 {ARCHIVE_DIR}")
    assert model.digest in _held(cluster, "lab-h1") and model.digest in _held(cluster, "lab-h3")


@pytest.mark.extended
def test_z_down_purge_removes_the_model_cache_and_staging_then_up_relays_the_image_verified(cluster: Lab) -> None:
    for hostname in ("lab-h1", "lab-h2", "lab-h3"):
        assert cluster.sh(hostname, f"ls {CACHE}").split(), hostname  # the models of the tests before
    code, doc, err = cluster.cli("down", "--purge", timeout=600)
    assert code == 0, err[-3000:]
    purged = {(p["host"], p["item"]) for p in doc["purged"]}
    for address, hostname in ((IP1, "lab-h1"), (IP2, "lab-h2"), (IP3, "lab-h3")):
        assert (address, "/etc/raycluster/lab") in purged and (address, ARCHIVE_DIR) in purged
        assert cluster.sh(hostname, f"ls -d {CACHE} {ARCHIVE_DIR} 2>/dev/null; true").strip() == ""
    # After the purge the image is gone too: `up` relays it again, each host's archive verified before its load.
    code, doc, err = cluster.cli("up", timeout=1500)
    assert code == 0, err[-3000:]
    assert sorted(t["host"] for t in doc["images"]) == [IP1, IP2, IP3]
    assert {t["checksum"] for t in doc["images"]} == {"sha256"}, doc["images"]
