"""Write the inventories fleet.sh uses from one fleet lab's `lab up --json` document: hosts-N.yaml for each
size (first N hosts), p2p.yaml (the first P2P hosts), ray.yaml (the first RAY hosts, num_cpus 1 each).

Usage: fleet_inventories.py LAB_JSON OUT_DIR SIZE... p2p:N ray:N IMAGE
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml


def subset(base: dict[str, Any], count: int, image: str, num_cpus: int | None = None) -> dict[str, Any]:
    hosts = base["hosts"][:count]
    doc = {**base, "image": image, "head": {"address": hosts[0]["address"]}}
    doc["hosts"] = [
        {
            "address": h["address"],
            "role": "head" if i == 0 else "worker",
            **({"num_cpus": num_cpus} if num_cpus else {}),
        }
        for i, h in enumerate(hosts)
    ]
    # Many Ray nodes share this machine: keep each object store small.
    doc["ray"] = {**doc.get("ray", {}), "object_store_memory": 100_000_000}
    doc["docker"] = {"shm_size": "256m"}
    return doc


def main() -> None:
    lab_json, out, *rest = sys.argv[1:]
    image = rest.pop()
    base = yaml.safe_load(Path(json.loads(Path(lab_json).read_text())["inventory"]).read_text())
    for item in rest:
        kind, _, value = item.rpartition(":")
        count = int(value)
        if count == 0:
            continue
        name = {"": f"hosts-{count}", "p2p": "p2p", "ray": "ray"}[kind]
        doc = subset(base, count, image, 1 if kind == "ray" else None)
        Path(out, f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


if __name__ == "__main__":
    main()
