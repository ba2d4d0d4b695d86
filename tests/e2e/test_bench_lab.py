"""bench on the real 3-host lab: placement, metrics, GPT-2 weights from each host's disk, and a
partition that follows measured speed when one host gets a smaller CPU quota.

The module brings the cluster up itself and leaves it as it found it (up or down, with the lab's
own inventory).  Variant inventories (a model directory mounted read-only, CPU quotas) are applied
with down + up and the original is restored at the end.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raycluster_cli.lab import hosts as lab

from ..bench_checkpoints import write_random_gpt2
from ..bench_report_checks import (
    assert_balance_is_the_stages,
    assert_ceiling_is_the_busiest_stage,
    assert_latencies_are_the_runs,
    assert_reference_is_the_same_workload,
)
from .conftest import DOCKER, IP3, Lab

pytestmark = [pytest.mark.lab, pytest.mark.slow]

MODEL_DIR = "/srv/raycluster-bench/tiny-gpt2"  # the same path on every lab host and in every container


class Cluster:
    """The lab's cluster and which inventory it currently runs with."""

    def __init__(self, lab_hosts: Lab) -> None:
        self.lab = lab_hosts
        self.current = lab_hosts.inventory

    def use(self, inventory: str) -> None:
        if inventory == self.current:
            return
        code, _, err = self.lab.cli("down", inventory=self.current)
        assert code == 0, err
        code, doc, err = self.lab.cli("up", inventory=inventory)
        assert code == 0, err
        assert all(n["alive"] for n in doc["nodes"])
        self.current = inventory

    def bench(self, *args: str) -> dict[str, Any]:
        code, doc, err = self.lab.cli("bench", *args, inventory=self.current, timeout=1500)
        assert code == 0, f"{doc}\n{err[-3000:]}"
        return doc


@pytest.fixture(scope="module")
def cluster(lab_hosts: Lab) -> Iterator[Cluster]:
    code, doc, err = lab_hosts.cli("up")
    assert code == 0, err
    was_up = all(n.get("action") == "running" for n in doc["nodes"])
    the_cluster = Cluster(lab_hosts)
    yield the_cluster
    the_cluster.use(lab_hosts.inventory)
    if not was_up:
        lab_hosts.cli("down")


def _stage_metrics_present(stage: dict[str, Any]) -> None:
    for key in ("host", "layers", "busy_s", "cpu_s", "capacity_s", "idle_s", "predicted_s", "calls", "num_threads"):
        assert stage.get(key) is not None, key
    assert stage["busy_s"] > 0 and stage["predicted_s"] > 0 and stage["device"] == "cpu"
    # the idle split from the stage's own call times adds up to its idle time (clocks differ by a round trip)
    parts = stage["idle_fill_s"] + stage["idle_between_s"] + stage["idle_drain_s"]
    assert abs(parts - stage["idle_s"]) < 0.05 + 0.02 * stage["idle_s"], (parts, stage["idle_s"])
    assert len(stage["idle_between_windows_s"]) == 5
    assert sum(stage["idle_between_windows_s"]) == pytest.approx(stage["idle_between_s"], abs=0.05)


def test_bench_three_stages_on_three_hosts_with_every_metric(cluster: Cluster, tmp_path: Path) -> None:
    svg = tmp_path / "bench.svg"
    doc = cluster.bench("--quick", "--check-output", f"--save-svg={svg}")
    assert svg.read_text().startswith("<svg")
    hosts = {h.address for h in cluster.lab.info.hosts}
    stages = doc["stages"]
    assert len(stages) == 3 and {s["host"] for s in stages} == hosts
    assert [s["index"] for s in stages] == [0, 1, 2]
    assert stages[0]["has_embedding"] and stages[-1]["has_head"]
    assert sum(s["layers"] for s in stages) == doc["config"]["model"]["layers"]
    for stage in stages:
        _stage_metrics_present(stage)
    assert doc["completed"] == doc["requests"] == 12  # what --quick runs (bench/options.py QUICK): 12 requests
    assert doc["generated_tokens"] == 12 * 8 and doc["failed"] == 0  # of 8 new tokens each
    assert_latencies_are_the_runs(doc)
    assert_balance_is_the_stages(doc)
    assert 0 < doc["hop_overhead"]["per_hop_s"] < 0.1  # a hop between lab hosts: milliseconds (2.8–4 ms measured)
    refs = doc["references"]
    other = "balanced" if doc["split_choice"]["used"] == "even" else "even"  # the split not used is a reference
    same = doc["split_choice"]["reason"] == "the balanced split is the even split"  # then there is no other split
    for name in ([] if same else [other]) + ["unsharded"]:
        assert_reference_is_the_same_workload(doc, name)
    assert_ceiling_is_the_busiest_stage(doc)
    assert len(refs["unsharded"]["busy_s"]) == 1 and refs["unsharded"]["host"] in hosts
    assert {c["host"] for c in doc["calibration"]["nodes"]} == hosts
    assert doc["output_check"]["identical"] is True


@pytest.mark.extended
def test_bench_gpt2_weights_from_each_host(cluster: Cluster, tmp_path: Path) -> None:
    local = write_random_gpt2(tmp_path / "tiny-gpt2", layers=6, d_model=64, heads=4, vocab=256, positions=64)
    for host in cluster.lab.info.hosts:
        cluster.lab.sh(host.hostname, f"rm -rf {MODEL_DIR} && mkdir -p {MODEL_DIR}")
        subprocess.run([DOCKER, "cp", f"{local}/.", f"{host.name}:{MODEL_DIR}"], check=True, timeout=120)
    variant = cluster.lab.variant(
        tmp_path / "with-model.yaml",
        lambda inv: inv["docker"].setdefault("run_options", []).append(f"--volume={MODEL_DIR}:{MODEL_DIR}:ro"),
    )
    cluster.use(variant)
    doc = cluster.bench(
        f"--model-path={MODEL_DIR}",
        "--requests=8",
        "--prompt-len=8",
        "--max-new-tokens=8",
        "--micro-batch=2",
        "--check-output",
        "--no-references",
        "--calibration-repeats=2",
    )
    assert doc["config"]["model_source"] == f"gpt2:{MODEL_DIR}"
    assert doc["config"]["model"]["layers"] == 6 and doc["config"]["model"]["vocab"] == 256
    assert len({s["host"] for s in doc["stages"]}) == 3
    assert doc["completed"] == 8
    assert doc["output_check"]["identical"] is True and doc["output_check"]["compared_requests"] >= 8


def test_slow_host_gets_fewer_layers_and_balanced_evens_out_busy_time(cluster: Cluster, tmp_path: Path) -> None:
    # The slow host has 0.3 of a CPU: at 0.2 on a machine half as fast as earlier sessions' (2026-12-02) its
    # Ray node did not register within Ray's own fixed 30 s (`ray/_private/node.py`: the raylet waits for its
    # Python agents, about 5 CPU-seconds there), twice, and `up` failed before the bench could run.
    quotas = {"lab-h1": "1.0", "lab-h2": "1.0", "lab-h3": "0.3"}

    def limit(inv: dict[str, Any]) -> None:
        for index, host in enumerate(inv["hosts"]):
            host.setdefault("docker", {})["run_options"] = lab.cpu_options(quotas[f"lab-h{index + 1}"])

    cluster.use(cluster.lab.variant(tmp_path / "unequal.yaml", limit))
    doc = cluster.bench("--layers=24", "--requests=16", "--max-new-tokens=8", "--partition=balanced")
    by_host = {s["host"]: s for s in doc["stages"]}
    slow = by_host[IP3]
    # `up` advertises one CPU for a 0.3 quota (Ray would round it down to 0); the stage reads the quota itself:
    # one thread.
    assert slow["cpu_quota"] == pytest.approx(0.3) and slow["num_threads"] == 1
    # its capacity time is its CPU time over its quota's share (at most the quota): what its work costs the node
    assert slow["capacity_s"] >= slow["process_cpu_s"] / 0.3 * 0.999, slow
    capacity = [s["capacity_s"] for s in doc["stages"]]
    assert doc["imbalance_capacity"] == pytest.approx((max(capacity) - min(capacity)) / (sum(capacity) / 3), rel=1e-6)
    assert all(slow["layers"] < s["layers"] for host, s in by_host.items() if host != IP3), doc["partition_ranges"]
    # Balance, not speed: a 16-request run's throughput is noise on a shared machine (CI saw balanced at
    # 0.96x even with the even split's imbalance at 1.36); the busy-time spread is what the split sets.
    # Throughput against the even split is measured by benchmarks/bench_targets.sh, not asserted here.
    even = doc["references"]["even"]
    assert doc["imbalance"] < even["imbalance"], (doc["imbalance"], even)


ON_EVERY_NODE = """
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ray.init()


@ray.remote(num_cpus=1)
def where():
    return ray.util.get_node_ip_address()


nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
tasks = [where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote() for n in nodes]
print("ran on", sorted(set(ray.get(tasks, timeout=120))), flush=True)
"""


def test_ordinary_tasks_run_on_a_host_under_one_cpu(cluster: Cluster, tmp_path: Path) -> None:
    """A host whose Ray container has a third of a core still offers a CPU: a job's 1-CPU task runs on every node
    (with Ray's own count, 0 CPUs there, the task pinned to that node never runs and the job times out)."""
    quotas = {"lab-h1": "1.0", "lab-h2": "0.5", "lab-h3": "0.3"}

    def limit(inv: dict[str, Any]) -> None:
        for index, host in enumerate(inv["hosts"]):
            host.setdefault("docker", {})["run_options"] = lab.cpu_options(quotas[f"lab-h{index + 1}"])

    cluster.use(cluster.lab.variant(tmp_path / "fractional.yaml", limit))
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "where.py").write_text(ON_EVERY_NODE)
    command = [sys.executable, "-m", "raycluster_cli.cli", "submit", "-i", cluster.current, "--json"]
    command += ["--working-dir", str(tmp_path / "job"), "--", "python", "where.py"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400)
    doc = json.loads(done.stdout)
    assert done.returncode == 0 and doc["job"]["status"] == "SUCCEEDED", done.stderr[-3000:]
    hosts = sorted(h.address for h in cluster.lab.info.hosts)
    assert f"ran on {hosts}" in done.stderr, done.stderr[-3000:]


KILL_WORKER = "docker kill $(docker ps -q --filter label=io.raycluster.cluster=lab)"
STAGE_WORKERS = "docker exec $(docker ps -q --filter label=io.raycluster.cluster=lab) pgrep -f _StageWorker || true"


def _bench_until_counting(lab_hosts: Lab, inventory: str, *args: str) -> tuple[subprocess.Popen[str], list[str]]:
    """Start `raycluster bench` and read its progress lines (stderr) until the counted run has completed some."""
    command = [sys.executable, "-m", "raycluster_cli.cli", "bench", *args, "-i", inventory, "--json"]
    bench = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert bench.stderr is not None
    seen: list[str] = []
    for line in bench.stderr:
        seen.append(line)
        found = re.search(r"counted run: requests (\d+)/", line)
        if found and int(found.group(1)) > 0:
            return bench, seen
    pytest.fail(f"bench ended before counting requests: {''.join(seen)[-3000:]}")


def _restore(cluster: Cluster) -> None:
    code, doc, err = cluster.lab.cli("up", inventory=cluster.current)
    assert code == 0 and all(n["alive"] for n in doc["nodes"]), err


def test_worker_killed_during_bench_names_host_stage_and_counts(cluster: Cluster) -> None:
    """One pipeline: the lost stage ends the run, exit 1 within 60 s, with the counts; no actor stays."""
    cluster.use(cluster.lab.inventory)
    # Issue 10's case: 1000 requests, 64 in flight (16 micro-batches of 4). Each request is long enough (32
    # tokens, d_model 128) that the run is far from its end when the worker dies, on a quiet machine too
    # (with 4 tokens of d_model 64 the 1000 finished within the second after the kill on CI's).
    small = ("--layers=3", "--d-model=128", "--max-new-tokens=32", "--partition=even", "--refine=0")
    load = ("--requests=1000", "--micro-batch=4", "--in-flight=16", "--no-references", "--calibration-repeats=1")
    try:
        bench, _ = _bench_until_counting(cluster.lab, cluster.current, *small, *load, "--no-network-check")
        try:
            cluster.lab.sh("lab-h3", KILL_WORKER)
            killed = time.monotonic()
            out, err = bench.communicate(timeout=120)
            took = time.monotonic() - killed
        finally:
            bench.kill()
        assert bench.returncode == 1 and took < 60, (took, err[-2000:])
        doc = json.loads(out)
        failure = doc["failure"]
        assert doc["ok"] is False and failure["host"] == IP3 and failure["stage"] == 2
        assert failure["completed"] + failure["failed"] == failure["requests"] == 1000
        assert 0 < failure["completed"] < 1000
        assert IP3 in doc["error"]["message"] and "stage 2" in doc["error"]["message"]
        for hostname in ("lab-h1", "lab-h2"):  # the driver's shutdown ended every stage actor
            deadline = time.monotonic() + 30
            while cluster.lab.sh(hostname, STAGE_WORKERS).strip() and time.monotonic() < deadline:
                time.sleep(1)
            assert not cluster.lab.sh(hostname, STAGE_WORKERS).strip(), hostname
    finally:
        _restore(cluster)  # a failure here must not leave the next test a dead worker


@pytest.mark.extended  # tests/local/test_bench_pipeline_local.py's replica-lost tests are its twins
def test_replica_lost_mid_run_is_retried_and_named(cluster: Cluster) -> None:
    """Three replicas of one stage: a worker killed mid-run; its requests finish on the other two."""
    cluster.use(cluster.lab.inventory)
    args = ("--stages=1", "--layers=2", "--d-model=64", "--max-new-tokens=4", "--requests=6000", "--micro-batch=2")
    try:
        bench, _ = _bench_until_counting(cluster.lab, cluster.current, *args, "--no-references", "--no-network-check")
        try:
            cluster.lab.sh("lab-h3", KILL_WORKER)
            out, err = bench.communicate(timeout=600)
        finally:
            bench.kill()
        assert bench.returncode == 0, err[-3000:]
        doc = json.loads(out)
        assert doc["completed"] == doc["requests"] == 6000 and doc["failed"] == 0
        [lost] = doc["lost_nodes"]
        assert lost["host"] == IP3 and lost["phase"] == "counted run" and lost["requests_retried"] > 0
        assert doc["retried_requests"] == lost["requests_retried"]
        assert [r["lost"] for r in doc["replicas"]] == [False, False, True]
        assert f"node {IP3} (stage 0) lost" in err
    finally:
        _restore(cluster)
