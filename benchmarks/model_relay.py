"""Relay a model folder onto every host of an inventory (hosts that lack it) and print, per round, one line of JSON:
the bytes this machine sent into the lab network (the lab bridge's tx_bytes, measured outside the program) as
copies of the model's tar, for the relay's first run, its second run (every host holds the model), and the
operator-only reference (every host streamed from here, as before the relay), alternated within each round, with
wall times. Each round writes a fresh model (random padding), so no host holds it before its first run.

With SHARDS > 1 the weights are that many files, and each round then also changes one shard ("changed_shard") and
then config.json ("changed_config") and relays each new version to hosts that hold the one before: only the
changed file travels (delivery/model_delta.py), reported as copies of the new model's tar and of the changed file.

The cluster must be up (the models go into its host folders). Usage:
  PYTHONPATH=. python benchmarks/model_relay.py INVENTORY BRIDGE_TX_BYTES_FILE SIZE_MB ROUNDS [SHARDS]
e.g. BRIDGE_TX_BYTES_FILE=/sys/class/net/br-<network id[:12]>/statistics/tx_bytes.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from raycluster_cli.config import inventory
from raycluster_cli.delivery import model_relay, relay
from raycluster_cli.delivery.models import read_model_folder
from raycluster_cli.host.folders import models_dir
from raycluster_cli.transport import quote
from raycluster_cli.transport.pool import SSHPool


def _model(folder: Path, size: int, shards: int = 1) -> str:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2}')
    if shards == 1:
        (folder / "model.safetensors").write_bytes(uuid.uuid4().bytes + os.urandom(size))
    for index in range(shards if shards > 1 else 0):
        shard = folder / f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        shard.write_bytes(uuid.uuid4().bytes + os.urandom(size // shards))
    return str(folder)


def _changes(folder: str, shards: int) -> list[tuple[str, Path, str]]:
    """The later versions of a sharded model: one shard rewritten, then config.json (kind, file, new bytes)."""
    shard = Path(folder) / f"model-00002-of-{shards:05d}.safetensors"
    return [("changed_shard", shard, "shard"), ("changed_config", Path(folder) / "config.json", "config")]


def _rewrite(file: Path, what: str) -> None:
    if what == "shard":
        file.write_bytes(uuid.uuid4().bytes + os.urandom(file.stat().st_size - 16))
    else:
        file.write_text(file.read_text()[:-1] + f', "revision": "{uuid.uuid4().hex}"}}')


def _remove(inv: inventory.Inventory, pool: SSHPool, digests: list[str]) -> None:
    """The lab's disks: the benchmark's models go again (their folders made writable, never their files: some
    are linked into another model)."""
    for host in inv.hosts:
        for digest in digests:
            stored = quote(f"{models_dir(inv, host)}/{digest}")
            pool(host).run(f"find {stored} -type d -exec chmod u+w {{}} + 2>/dev/null; rm -rf -- {stored}", timeout=120)


def _run(inv: inventory.Inventory, pool: SSHPool, path: str, bridge: Path) -> tuple[int, float, list[str]]:
    before = int(bridge.read_text())
    started = time.monotonic()
    _, _, copies = model_relay.place_model(inv, pool, path)
    return int(bridge.read_text()) - before, time.monotonic() - started, [c.source or c.action for c in copies]


def main() -> None:
    path, bridge_file, size_mb, rounds, *more = sys.argv[1:]
    shards = int(more[0]) if more else 1
    inv = inventory.load(path).inventory
    bridge = Path(bridge_file)
    pool = SSHPool(inv)
    for host in inv.hosts:
        pool(host)  # connections first: their handshakes are not the model
    with_peers = relay.TOOLS_COMMAND
    operator_only = with_peers.replace(" bash timeout", "")  # no host can receive from a peer: each from here
    figures: dict[str, list[float]] = {"first": [], "second": [], "operator_only": []}
    if shards > 1:
        figures |= {"changed_shard": [], "changed_config": []}
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(int(rounds)):
            order = ["relay", "operator_only"] if index % 2 == 0 else ["operator_only", "relay"]
            row: dict[str, object] = {"round": index + 1}
            for kind in order:
                folder = _model(Path(scratch) / f"m{index}-{kind}", int(size_mb) << 20, shards)
                relay.TOOLS_COMMAND = operator_only if kind == "operator_only" else with_peers
                model = read_model_folder(folder)
                tar = model.tar_size
                sent, wall, sources = _run(inv, pool, folder, bridge)
                row[kind] = {"copies": round(sent / tar, 3), "wall_s": round(wall, 2), "sources": sources}
                figures["first" if kind == "relay" else "operator_only"].append(sent / tar)
                digests = [model.digest]
                if kind == "relay":
                    sent, wall, sources = _run(inv, pool, folder, bridge)
                    row["second"] = {"copies": round(sent / tar, 4), "wall_s": round(wall, 2), "sources": sources}
                    figures["second"].append(sent / tar)
                for change, file, what in _changes(folder, shards) if kind == "relay" and shards > 1 else []:
                    _rewrite(file, what)
                    changed = read_model_folder(folder)
                    digests.append(changed.digest)
                    sent, wall, sources = _run(inv, pool, folder, bridge)
                    row[change] = {
                        "copies": round(sent / changed.tar_size, 4),
                        "of_changed_file": round(sent / file.stat().st_size, 3),
                        "changed_bytes": file.stat().st_size,
                        "wall_s": round(wall, 2),
                        "sources": sources,
                    }
                    figures[change].append(sent / changed.tar_size)
                _remove(inv, pool, digests)
            print(json.dumps(row), flush=True)
    relay.TOOLS_COMMAND = with_peers
    pool.close()
    summary = {k: {"median": round(statistics.median(v), 4), "min": round(min(v), 4), "max": round(max(v), 4)}
               for k, v in figures.items() if v}  # fmt: skip
    print(
        json.dumps({"size_mb": int(size_mb), "shards": shards, "hosts": len(inv.hosts), "summary": summary}), flush=True
    )


if __name__ == "__main__":
    main()
