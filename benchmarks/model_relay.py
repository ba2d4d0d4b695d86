"""Relay a model folder onto every host of an inventory (hosts that lack it) and print, per round, one line of JSON:
the bytes this machine sent into the lab network (the lab bridge's tx_bytes, measured outside the program) as
copies of the model's tar, for the relay's first run, its second run (every host holds the model), and the
operator-only reference (every host streamed from here, as before the relay), alternated within each round, with
wall times. Each round writes a fresh model (random padding), so no host holds it before its first run.

The cluster must be up (the models go into its host folders). Usage:
  PYTHONPATH=. python benchmarks/model_relay.py INVENTORY BRIDGE_TX_BYTES_FILE SIZE_MB ROUNDS
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
from raycluster_cli.host.folders import models_dir
from raycluster_cli.image import model_relay, relay
from raycluster_cli.image.models import read_model_folder
from raycluster_cli.transport import quote
from raycluster_cli.transport.pool import SSHPool


def _model(folder: Path, size: int) -> str:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2}')
    (folder / "model.safetensors").write_bytes(uuid.uuid4().bytes + os.urandom(size))
    return str(folder)


def _run(inv: inventory.Inventory, pool: SSHPool, path: str, bridge: Path) -> tuple[int, float, list[str]]:
    before = int(bridge.read_text())
    started = time.monotonic()
    _, _, copies = model_relay.place_model(inv, pool, path)
    return int(bridge.read_text()) - before, time.monotonic() - started, [c.source or c.action for c in copies]


def main() -> None:
    path, bridge_file, size_mb, rounds = sys.argv[1:]
    inv = inventory.load(path).inventory
    bridge = Path(bridge_file)
    pool = SSHPool(inv)
    for host in inv.hosts:
        pool(host)  # connections first: their handshakes are not the model
    with_peers = relay.TOOLS_COMMAND
    operator_only = with_peers.replace(" bash timeout", "")  # no host can receive from a peer: each from here
    figures: dict[str, list[float]] = {"first": [], "second": [], "operator_only": []}
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(int(rounds)):
            order = ["relay", "operator_only"] if index % 2 == 0 else ["operator_only", "relay"]
            row: dict[str, object] = {"round": index + 1}
            for kind in order:
                folder = _model(Path(scratch) / f"m{index}-{kind}", int(size_mb) << 20)
                relay.TOOLS_COMMAND = operator_only if kind == "operator_only" else with_peers
                model = read_model_folder(folder)
                tar = model.tar_size
                sent, wall, sources = _run(inv, pool, folder, bridge)
                row[kind] = {"copies": round(sent / tar, 3), "wall_s": round(wall, 2), "sources": sources}
                figures["first" if kind == "relay" else "operator_only"].append(sent / tar)
                if kind == "relay":
                    sent, wall, sources = _run(inv, pool, folder, bridge)
                    row["second"] = {"copies": round(sent / tar, 4), "wall_s": round(wall, 2), "sources": sources}
                    figures["second"].append(sent / tar)
                for host in inv.hosts:  # the lab's disks: the benchmark's models go again
                    stored = quote(f"{models_dir(inv, host)}/{model.digest}")
                    pool(host).run(f"chmod -R u+w {stored} 2>/dev/null; rm -rf -- {stored}", timeout=120)
            print(json.dumps(row), flush=True)
    relay.TOOLS_COMMAND = with_peers
    pool.close()
    summary = {k: {"median": round(statistics.median(v), 4), "min": round(min(v), 4), "max": round(max(v), 4)}
               for k, v in figures.items() if v}  # fmt: skip
    print(json.dumps({"size_mb": int(size_mb), "hosts": len(inv.hosts), "summary": summary}), flush=True)


if __name__ == "__main__":
    main()
