"""The model relay on a fleet lab (issue 30's fleet target): HOSTS lab hosts without the node image (no python3 on
the hosts), each round first the image relay (as `up` does: one seed, hosts serve hosts; the image has python3,
so once it is loaded a host's listener runs in it), then the relay of a fresh model of SIZE_MB random weights to
the same hosts. Printed per round, one line of JSON: for each, the bytes this machine sent into the lab network
(the lab bridge's tx_bytes, measured outside the program) as copies of what travels (the compressed image
archive, the model's tar), the wall time and its seconds per byte, and the model's seconds per byte ÷ the image's
(same lab, same round); the 1-minute load average before and after each. Then a summary (medians, min–max).

The image is small (Debian + python3-minimal, as tests/e2e/test_fleet_images.py builds it; the node image would
take minutes per round to load on shared cores): both relays' walls include each host's use of what it received
(`docker load`; the model's unpack and every file's SHA-256 against its manifest). The lab is made (own name and
subnet) and removed afterwards (KEEP=1 keeps it); each host's cluster folder is made as `up` makes it.

Usage: PYTHONPATH=. python benchmarks/model_relay_fleet.py HOSTS SIZE_MB ROUNDS
Env: LAB (default rc-fleet-model), SUBNET (default 10.87.0.0/24), BASE_IMAGE (raycluster/debian-base:bookworm).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from raycluster_cli.config import inventory
from raycluster_cli.delivery import deliver as images
from raycluster_cli.delivery import model_relay
from raycluster_cli.delivery.models import read_model_folder
from raycluster_cli.host.folders import make_dir_command, models_dir
from raycluster_cli.lab import hosts as lab
from raycluster_cli.lab.engines import build_small_image
from raycluster_cli.transport import quote
from raycluster_cli.transport.pool import SSHPool

T = TypeVar("T")
BASE_IMAGE = os.environ.get("BASE_IMAGE", "raycluster/debian-base:bookworm")


def _image(tag: str) -> str:
    """The small image with python3 (cached layers: the fleet test builds the same one)."""
    return build_small_image(lab.docker_client(), tag, BASE_IMAGE)


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _bridge(network: str) -> Path:
    net_id = lab.docker_client().networks.get(network).id
    return Path(f"/sys/class/net/br-{net_id[:12]}/statistics/tx_bytes")


def _timed(bridge: Path, run: Callable[..., T], *args: Any) -> tuple[int, float, T]:
    """What `run(*args)` sent into the lab network (bridge bytes), its wall time and its result."""
    before = int(bridge.read_text())
    started = time.monotonic()
    result = run(*args)
    return int(bridge.read_text()) - before, time.monotonic() - started, result


def main() -> None:
    hosts, size_mb, rounds = (int(a) for a in sys.argv[1:])
    name, subnet = os.environ.get("LAB", "rc-fleet-model"), os.environ.get("SUBNET", "10.87.0.0/24")
    tag = f"raycluster/p2ptest:{name}"
    image_id = _image(tag)
    scratch = Path(tempfile.mkdtemp(prefix="model-relay-fleet."))
    info = lab.lab_up(hosts, lab_dir=scratch / "lab", name=name, subnet=subnet, load_node_image=False)
    try:
        data = yaml.safe_load(info.inventory_path.read_text())
        data["image"] = tag
        (scratch / "inventory.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        inv = inventory.load(str(scratch / "inventory.yaml")).inventory
        archive = images._archive(tag, image_id, "zstd", scratch / "archives", lambda _: None)  # not timed
        pool = SSHPool(inv)
        for host in inv.hosts:  # connections first (their handshakes are not the content), the cluster folders
            pool(host).run(make_dir_command(inv, host), timeout=60)
        bridge = _bridge(info.network)
        figures: dict[str, list[float]] = {"image_copies": [], "model_copies": [], "model_per_byte_vs_image": []}
        for index in range(rounds):
            for host in inv.hosts:  # no host holds the image: the relay sends it to all
                pool(host).run(f"docker rmi -f {tag} >/dev/null 2>&1; true", timeout=120)
            plan = [images.ImageTransfer(str(h.address), "missing", "stream") for h in inv.hosts]
            load_before = _load()
            sent, wall, _ = _timed(
                bridge, images.distribute, inv, pool, plan, image_id, scratch / "archives", lambda _: None
            )
            size = archive.stat().st_size
            image = {"copies": round(sent / size, 3), "wall_s": round(wall, 2), "bytes": size,
                     "s_per_gb": round(wall / size * 1e9, 2), "load": [load_before, _load()]}  # fmt: skip
            folder = scratch / f"model-{index}"
            folder.mkdir()
            (folder / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2}')
            (folder / "model.safetensors").write_bytes(uuid.uuid4().bytes + os.urandom(size_mb << 20))
            model = read_model_folder(folder)
            load_before = _load()
            sent, wall, (_, _, copies) = _timed(bridge, model_relay.place_model, inv, pool, str(folder))
            relayed = {"copies": round(sent / model.tar_size, 3), "wall_s": round(wall, 2), "bytes": model.tar_size,
                       "s_per_gb": round(wall / model.tar_size * 1e9, 2), "load": [load_before, _load()],
                       "sources": sorted(c.source for c in copies)}  # fmt: skip
            ratio = relayed["s_per_gb"] / image["s_per_gb"]  # type: ignore[operator]
            print(json.dumps({"round": index + 1, "image": image, "model": relayed, "model_per_byte_vs_image":
                              round(ratio, 3)}), flush=True)  # fmt: skip
            figures["image_copies"].append(image["copies"])  # type: ignore[arg-type]
            figures["model_copies"].append(relayed["copies"])  # type: ignore[arg-type]
            figures["model_per_byte_vs_image"].append(ratio)
            for host in inv.hosts:
                stored = quote(f"{models_dir(inv, host)}/{model.digest}")
                pool(host).run(
                    f"find {stored} -type d -exec chmod u+w {{}} + 2>/dev/null; rm -rf -- {stored}", timeout=120
                )
        pool.close()
        summary = {k: {"median": round(statistics.median(v), 3), "min": round(min(v), 3), "max": round(max(v), 3)}
                   for k, v in figures.items()}  # fmt: skip
        print(json.dumps({"hosts": hosts, "size_mb": size_mb, "rounds": rounds, "summary": summary}), flush=True)
    finally:
        if os.environ.get("KEEP") != "1":
            lab.lab_down(lab_dir=scratch / "lab", name=name)


if __name__ == "__main__":
    main()
