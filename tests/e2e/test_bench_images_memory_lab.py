"""Image generation on the real 3-host lab whose Ray containers have memory limits below the whole pipeline's:
`bench` places its parts apart (text encoder | UNet | VAE decoder), runs with no out-of-memory kill, and its image
equals diffusers' own pipeline, run one part at a time on the nodes (the driver never holds the whole pipeline).

Every Ray container gets ``--memory=LIMIT`` (the text memory test's limit, which leaves Ray room to start; the head
holds ~1 GB of Ray's own, a worker ~0.5 GB) and the hosts are 1.0 / 0.5 / 0.25 of a CPU.  The checkpoint is the
tiny random SD made big where it costs memory and no compute: the text encoder's token table padded to TEXT_VOCAB
rows and the UNet's time embedding TIME_DIM wide (one matrix-vector product per call), stored in float16 and run
in float32, so each part's weights are the worker's own memory (a float32 file would be mapped page cache, charged
to whoever read it first).  In float32 the UNet is ~1 GB and the text encoder ~0.5 GB: the whole pipeline with a
worker process (~0.36 GB) and Ray's own is more than a worker container's limit, far more than the head's.
The throughput against the split's own pipeline ceiling is measured and printed (docs/PERFORMANCE.md), not asserted;
RAYCLUSTER_BENCH_IMAGES_MEMORY_RESULT=DIR keeps the report.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from raycluster_cli.lab import hosts as lab

from ..diffusion_checkpoint import write_tiny_sd
from .conftest import DOCKER, Lab, keep_report
from .test_bench_lab import Cluster

pytestmark = [pytest.mark.lab, pytest.mark.slow, pytest.mark.extended]

MODEL_DIR = "/srv/raycluster-bench/big-sd"
MIB = 1 << 20
LIMIT = 2400 * MIB  # every Ray container's memory limit (as tests/e2e/test_bench_memory_lab.py)
QUOTAS = {"lab-h1": "1.0", "lab-h2": "0.5", "lab-h3": "0.25"}
TEXT_VOCAB = 4_000_000  # x 32 wide x 4 bytes: a 488 MiB token table
TIME_DIM = 16_000  # a 16000 x 16000 time embedding: 977 MiB of the UNet
REQUESTS = int(os.environ.get("RAYCLUSTER_BENCH_IMAGES_MEMORY_REQUESTS", "12"))


@pytest.fixture(scope="module")
def limited(lab_hosts: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The cluster up with memory-limited, CPU-quota'd Ray containers and the big checkpoint on every host."""
    local = write_tiny_sd(
        tmp_path_factory.mktemp("big-sd") / "big-sd", width=64, text_vocab=TEXT_VOCAB, time_dim=TIME_DIM, half=True
    )
    for host in lab_hosts.info.hosts:
        lab_hosts.sh(host.hostname, f"rm -rf {MODEL_DIR} && mkdir -p {MODEL_DIR}")
        subprocess.run([DOCKER, "cp", f"{local}/.", f"{host.name}:{MODEL_DIR}"], check=True, timeout=300)

    def small(inv: dict[str, Any]) -> None:
        inv["ray"]["object_store_memory"] = 80_000_000
        inv["docker"].setdefault("run_options", []).append(f"--volume={MODEL_DIR}:{MODEL_DIR}:ro")
        for index, host in enumerate(inv["hosts"]):
            host.setdefault("docker", {})["run_options"] = [
                f"--memory={LIMIT}",
                f"--memory-swap={LIMIT}",
                *lab.cpu_options(QUOTAS[f"lab-h{index + 1}"]),
            ]

    cluster = Cluster(lab_hosts)
    cluster.use(lab_hosts.variant(tmp_path_factory.mktemp("inv") / "limited.yaml", small))
    yield cluster
    lab_hosts.cli("down", inventory=cluster.current, timeout=600)
    for host in lab_hosts.info.hosts:
        lab_hosts.sh_result(host.hostname, f"rm -rf {MODEL_DIR}")


def test_a_pipeline_no_container_holds_runs_as_its_parts_without_an_oom(limited: Cluster) -> None:
    doc = limited.bench(
        f"--model-path={MODEL_DIR}", f"--requests={REQUESTS}", "--image-steps=4", "--image-size=32", "--threads=1",
        "--calibration-repeats=1", "--check-output",
    )  # fmt: skip
    keep_report("RAYCLUSTER_BENCH_IMAGES_MEMORY_RESULT", "images-memory.json", doc)
    placement = doc["placement"]
    weights = sum(placement["weights_mib"].values()) * MIB
    rooms = placement["node_rooms"]
    ceiling = doc["references"]["ceiling"]
    print(
        f"\n{placement['why']}\nimages/s {doc['images_per_s']:.3f}, ÷ ceiling {ceiling['ratio']:.3f} (ceiling "
        f"{ceiling['images_per_s']:.3f}, busiest {ceiling['busiest']}), p50/p90/p99 {doc['latency_s']}\n"
        + "\n".join(
            f"{n['node_ip']} {n['parts']} busy {n['busy_s']:.2f}s calls {n['calls']} memory {n['memory']} "
            f"process peak {n['process_peak_rss_bytes'] / MIB:.0f} MiB"
            for n in doc["nodes"]
        ),
        file=sys.stderr,
    )
    # the rooms are the containers' (their cgroup limit), each below what the whole pipeline takes in float32
    assert all(r["source"].startswith("cgroup") and r["limit_mib"] == LIMIT // MIB for r in rooms), rooms
    assert all(r["room_mib"] * MIB < weights for r in rooms), (rooms, weights)
    assert "no node holds the whole pipeline" in placement["why"] and "unet_cut" not in placement
    (replica,) = placement["replicas"]
    assert [h["parts"] for h in replica["holders"]] == [["text"], ["unet"], ["vae"]]
    assert len({h["node_ip"] for h in replica["holders"]}) == 3
    # every image made, no worker lost, and no process killed for memory in any container
    assert doc["images"] == REQUESTS and not doc.get("lost")
    for node in doc["nodes"]:
        memory = node["memory"]
        assert memory["limit_bytes"] == LIMIT and memory["oom_kills"] == 0, node
        assert memory["working_set_bytes"] <= 0.95 * LIMIT, node  # below Ray's memory monitor's kill threshold
    unet = next(n for n in doc["nodes"] if n["parts"] == ["unet"])
    assert unet["process_peak_rss_bytes"] > placement["weights_mib"]["unet"] * MIB  # its weights were its own
    assert doc["output_check"]["identical"] is True, doc["output_check"]
