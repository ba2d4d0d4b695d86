"""The newer checks through the runner, hosts faked by tables of recorded output."""

from pathlib import Path

import pytest

from raycluster_cli.checks import CheckResult, Status, run_checks
from raycluster_cli.config import inventory
from raycluster_cli.config.inventory import HostConfig
from raycluster_cli.transport.base import CommandResult
from raycluster_cli.transport.fake import FakeTransport

from .test_checks import (
    CLOCK,
    CONTAINERS,
    ENGINE,
    ETC_HOSTS,
    IMAGE,
    PORTS,
    PROCESSES,
    disk_tables,
    engine,
    fleet,
    healthy,
    image,
    ps_json,
)

RECORDED = Path(__file__).parent / "recorded"
HEAD, W2, W3 = "192.0.2.11", "192.0.2.12", "192.0.2.13"
Table = dict[str, CommandResult | str]


def run(yaml_text: str, tables: dict[str, Table]) -> dict[tuple[str, str], CheckResult]:
    inv = inventory.parse(yaml_text)

    def connect(host: HostConfig) -> FakeTransport:
        return FakeTransport(str(host.address), tables[str(host.address)])

    return {(r.host, r.id): r for r in run_checks(inv, connect)}


def on(address: str, name: str, **overrides: CommandResult | str) -> dict[str, Table]:
    return fleet(**{address: healthy(address, name, **overrides)})


def test_healthy_fleet_has_no_warning_either(example_yaml: str) -> None:
    results = run(example_yaml, fleet())
    assert [k for k, r in results.items() if r.status != Status.OK] == []
    assert results[(W2, "image-runtime")].data == {"ray": "2.60.0", "python": "3.11.2"}
    assert results[(W2, "names")].status == Status.OK


def test_several_global_addresses_warn_naming_them(example_yaml: str) -> None:
    bridges = (RECORDED / "ip_addr_bridges.txt").read_text()
    results = run(example_yaml, on(W2, "node-2", **{r"^ip -o -4 addr show": bridges}))
    warn = results[(W2, "addresses")]
    assert warn.status == Status.WARN
    assert "192.0.2.12 (eno1), 192.0.2.112 (eno1)" in warn.message and "docker0" not in warn.message


def test_missing_ip_binary_warns_instead_of_failing(example_yaml: str) -> None:
    no_ip = CommandResult(127, "", "sh: 1: ip: not found")
    results = run(example_yaml, on(W2, "node-2", **{r"^ip -o -4 addr show": no_ip, r"^ip route get": no_ip}))
    assert results[(W2, "route-to-head")].status == Status.WARN
    assert results[(W2, "addresses")].status == Status.WARN
    assert "iproute2" in results[(W2, "route-to-head")].hint
    results = run(example_yaml, on(HEAD, "node-1", **{r"^ip -o -4 addr show": no_ip}))
    assert results[(HEAD, "head-address")].status == Status.FAIL
    assert "iproute2" in results[(HEAD, "head-address")].hint


def test_names_matrix_flags_the_host_with_the_wrong_line(example_yaml: str) -> None:
    hosts = "node-3\n---\n127.0.0.1 localhost\n192.0.2.13 node-3\n# the head moved\n192.0.2.99\tnode-1 head\n"
    results = run(example_yaml, on(W3, "node-3", **{ETC_HOSTS: hosts}))
    bad = results[(W3, "names")]
    assert bad.status == Status.FAIL
    assert "node-1 (host 192.0.2.11) → 192.0.2.99, should be 192.0.2.11" in bad.message
    assert "'192.0.2.11 node-1'" in bad.hint
    assert bad.data["resolves"] == {"node-1": "192.0.2.99", "node-2": None}
    assert results[("192.0.2.11", "names")].status == Status.OK


def test_names_matrix_loopback_for_another_host(example_yaml: str) -> None:
    hosts = "node-2\n---\n127.0.0.1 localhost node-3\n192.0.2.12 node-2\n"
    results = run(example_yaml, on(W2, "node-2", **{ETC_HOSTS: hosts}))
    assert "node-3 (host 192.0.2.13) → loopback 127.0.0.1" in results[(W2, "names")].message


def test_worker_port_range_taken_and_firewall_dropping(example_yaml: str) -> None:
    ss = (RECORDED / "ss_worker_range.txt").read_text()
    drop = (RECORDED / "iptables_drop.txt").read_text()
    results = run(example_yaml, on(W2, "node-2", **{PORTS: f"{ss}---\n{drop}---\n"}))
    warn = results[(W2, "worker-ports")]
    assert warn.status == Status.WARN
    assert "2 port(s) of the worker range 10002-19999 already listening: 10005, 12345" in warn.message
    assert "iptables INPUT policy DROP" in warn.message and "10002-19999" in warn.hint


def test_worker_port_range_held_by_our_node_is_fine(example_yaml: str) -> None:
    ss = (RECORDED / "ss_worker_range.txt").read_text()
    ours = ps_json(("82c21fa8c7db", "raycluster-demo-worker", "running", {"io.raycluster.cluster": "demo"}))
    results = run(example_yaml, on(W2, "node-2", **{PORTS: f"{ss}---\n---\n", CONTAINERS: ours}))
    assert results[(W2, "worker-ports")].status == Status.OK


def test_worker_ports_come_from_the_inventory(example_yaml: str) -> None:
    text = example_yaml.replace("\nhosts:", "\nray: {min_worker_port: 12000, max_worker_port: 12100}\nhosts:")
    ss = (RECORDED / "ss_worker_range.txt").read_text()
    results = run(text, on(W2, "node-2", **{PORTS: f"{ss}---\n---\n"}))
    assert results[(W2, "worker-ports")].status == Status.OK
    assert results[(W2, "worker-ports")].data["range"] == "12000-12100"


def test_clock_ahead_warns(example_yaml: str) -> None:
    results = run(example_yaml, on(W2, "node-2", **{CLOCK: "4102444800.0\n"}))  # the year 2100
    assert results[(W2, "clock")].status == Status.WARN
    assert "ahead of" in results[(W2, "clock")].message and "NTP" in results[(W2, "clock")].hint


def test_ray_version_mismatch_fails_python_mismatch_warns(example_yaml: str) -> None:
    results = run(example_yaml, on(W2, "node-2", **{IMAGE: image(versions="python 3.11.2\nray 2.9.3\n")}))
    bad = results[(W2, "image-runtime")]
    assert bad.status == Status.FAIL and "Ray 2.9.3, the CLI expects 2.60.0" in bad.message
    assert "ray[default]==2.60.0" in bad.hint
    results = run(example_yaml, on(W3, "node-3", **{IMAGE: image(versions="python 3.12.1\nray 2.60.0\n")}))
    assert results[(W3, "image-runtime")].status == Status.WARN


def test_image_without_ray_and_absent_image(example_yaml: str) -> None:
    broken = CommandResult(1, image(versions="ModuleNotFoundError: No module named 'ray'\n"), "")
    results = run(example_yaml, on(W2, "node-2", **{IMAGE: broken}))
    assert results[(W2, "image-runtime")].status == Status.FAIL
    assert "No module named 'ray'" in results[(W2, "image-runtime")].message
    missing = CommandResult(1, "no-image\n", "Error: No such image: raycluster/node:0.1.0")
    results = run(example_yaml, on(W3, "node-3", **{IMAGE: missing}))
    assert results[(W3, "image-runtime")].status == Status.SKIP
    assert results[(W3, "image")].status == Status.FAIL


def test_shm_below_the_default_object_store(example_yaml: str) -> None:
    # No ray.object_store_memory: Ray takes 30 % of the host's memory, far above the 2g shm.
    meminfo = "MemTotal:       263842012 kB\nMemAvailable:   250000000 kB\n"
    results = run(example_yaml, on(W2, "node-2", **{r"^cat /proc/meminfo": meminfo}))
    warn = results[(W2, "shm")]
    assert warn.status == Status.WARN
    assert "2.0 GiB, docker.shm_size" in warn.message and "docker.shm_size: 76g" in warn.hint
    assert "--shm-size=76g" in warn.hint


def test_shm_from_run_options_and_per_host(example_yaml: str) -> None:
    text = example_yaml.replace('run_options: ["--cpus=0.5"]', 'run_options: ["--cpus=0.5 --shm-size=100g"]')
    meminfo = "MemTotal:       263842012 kB\nMemAvailable:   250000000 kB\n"
    results = run(text, fleet(**{W3: healthy(W3, "node-3", **{r"^cat /proc/meminfo": meminfo})}))
    assert results[(W3, "shm")].status == Status.OK


def test_memory_below_the_configured_object_store_fails(example_yaml: str) -> None:
    text = example_yaml.replace("\nhosts:", "\nray: {object_store_memory: 8000000000}\nhosts:")
    meminfo = "MemTotal:       16000000 kB\nMemAvailable:   4000000 kB\n"
    results = run(text, on(W2, "node-2", **{r"^cat /proc/meminfo": meminfo}))
    assert results[(W2, "memory")].status == Status.FAIL
    assert "3.8 GiB memory available, less than ray.object_store_memory (7.5 GiB)" in results[(W2, "memory")].message


def test_low_disk_fails_for_docker_and_warns_for_tmp(example_yaml: str) -> None:
    disk = (
        "/data/docker\n---\nFilesystem 1-blocks Used Available Capacity Mounted on\n"
        "/dev/sdb1 100000000000 99500000000 500000000 99% /data\n"
        "/dev/sda1 50000000000 49900000000 100000000 99% /\n---\n" + "MemTotal: 16000000 kB\n"
    )
    results = run(example_yaml, on(W2, "node-2", **disk_tables(disk)))
    bad = results[(W2, "disk")]
    assert bad.status == Status.FAIL and "0.5 GiB free for Docker (/data/docker)" in bad.message
    assert "docker system prune" in bad.hint


GPU_YAML = """
cluster: demo
image: raycluster/node:0.1.0
hosts:
  - {address: 192.0.2.11, role: head}
  - {address: 192.0.2.12, role: worker, num_gpus: 8}
  - {address: 192.0.2.13, role: worker}
"""


def gpu_answer(smi: str, runtimes: str) -> dict[str, str]:
    """nvidia-smi's answer, and Docker's runtimes in the host's one `docker info`."""
    return {r"^nvidia-smi": f"{smi}---\n", ENGINE: engine(runtimes=runtimes)}


@pytest.mark.parametrize(
    ("answer", "status", "text"),
    [
        (
            gpu_answer(
                (RECORDED / "nvidia_smi_8gpu.csv").read_text(), (RECORDED / "docker_runtimes_nvidia.json").read_text()
            ),
            Status.OK,
            "8 GPU(s) and the nvidia runtime",
        ),
        (
            gpu_answer((RECORDED / "nvidia_smi_8gpu.csv").read_text(), '{"runc":{"path":"runc"}}'),
            Status.FAIL,
            "no nvidia runtime",
        ),
        (gpu_answer("sh: 1: nvidia-smi: not found\nrc=127\n", "{}"), Status.FAIL, "nvidia-smi is not installed"),
        (
            gpu_answer((RECORDED / "nvidia_smi_no_driver.txt").read_text(), "{}"),
            Status.FAIL,
            "nvidia-smi fails (NVIDIA-SMI has failed",
        ),
        (
            gpu_answer("0, NVIDIA A10, 23028 MiB\n1, NVIDIA A10, 23028 MiB\nrc=0\n", "{}"),
            Status.FAIL,
            "num_gpus: 8 but nvidia-smi lists 2 GPU(s)",
        ),
    ],
    ids=["good", "no-runtime", "no-nvidia-smi", "no-driver", "too-few"],
)
def test_gpus(answer: dict[str, str], status: Status, text: str) -> None:
    results = run(GPU_YAML, on(W2, "node-2", **answer))
    assert results[(W2, "gpus")].status == status
    assert text in results[(W2, "gpus")].message
    assert (W3, "gpus") not in results  # only where GPUs are asked for


def _recorded(name: str) -> str:
    return (RECORDED / name).read_text()


# Recorded on a lab host: Ray in a foreign container next to a container labelled as cluster `lab`'s (each with
# its gcs_server, raylet and ray:: processes), plus a stopped container; then the same host without the foreign
# one. The processes are placed in their containers by their cgroups; the containers come from `docker ps -a`.
FOREIGN = {PROCESSES: _recorded("stale_ray_processes_h2.txt"), CONTAINERS: _recorded("stale_ray_containers_h2.jsonl")}
OURS = {
    PROCESSES: _recorded("stale_ray_processes_ours_h2.txt"),
    CONTAINERS: _recorded("stale_ray_containers_ours_h2.jsonl"),
}


def test_stale_ray_container_and_host_process(example_yaml: str) -> None:
    on_host = "   1 /sbin/init\n 4242 /usr/local/lib/python3.11/dist-packages/ray/core/src/ray/gcs/gcs_server\n---\n"
    tables = fleet(**{W2: healthy(W2, "node-2", **FOREIGN), W3: healthy(W3, "node-3", **{PROCESSES: on_host})})
    results = run(example_yaml.replace("cluster: demo", "cluster: lab"), tables)
    bad = results[(W2, "stale-ray")]
    assert bad.status == Status.FAIL and "foreign-ray" in bad.message and "raycluster-lab-worker" not in bad.message
    assert "on the host itself" not in bad.message  # every Ray process of the host is placed in its container
    assert "docker rm -f foreign-ray" in bad.hint
    host = results[(W3, "stale-ray")]
    assert host.status == Status.FAIL and "4242 gcs_server" in host.message and "ray stop" in host.hint


def test_our_own_cluster_is_not_stale(example_yaml: str) -> None:
    results = run(example_yaml.replace("cluster: demo", "cluster: lab"), on(W2, "node-2", **OURS))
    assert results[(W2, "stale-ray")].status == Status.OK
    # ...but the same containers are foreign to another cluster.
    results = run(example_yaml, on(W2, "node-2", **OURS))
    assert results[(W2, "stale-ray")].status == Status.FAIL
    assert "raycluster-lab-worker" in results[(W2, "stale-ray")].message


def test_head_ports_check_unchanged(example_yaml: str) -> None:
    taken = "LISTEN 0 4096 0.0.0.0:8265 0.0.0.0:*\n---\n"
    results = run(example_yaml, on("192.0.2.11", "node-1", **{PORTS: taken}))
    assert results[("192.0.2.11", "ports-free")].status == Status.FAIL


def test_image_must_fit_where_it_is_missing(example_yaml: str) -> None:
    def disk(free: int, image: str) -> str:
        return (
            "/var/lib/docker\n---\nFilesystem 1-blocks Used Available Capacity Mounted on\n"
            f"/dev/sda1 900000000000 1 {free} 1% /\n/dev/sda1 900000000000 1 {free} 1% /\n---\n"
            f"MemTotal: 6000000 kB\n---\n{image}\n"
        )

    tables = fleet(
        **{
            HEAD: healthy(HEAD, "node-1", **disk_tables(disk(500 * 10**9, "5000000000"))),
            W2: healthy(W2, "node-2", **disk_tables(disk(4 * 10**9, "absent"))),
            W3: healthy(W3, "node-3", **{**disk_tables(disk(400 * 10**9, "absent")), IMAGE: image()}),
        }
    )
    results = run(example_yaml, tables)
    bad = results[(W2, "image-fits")]
    assert bad.status == Status.FAIL
    assert "(4.7 GiB on the other hosts) is missing here and only 3.7 GiB are free" in bad.message
    assert (W3, "image-fits") not in results  # enough room there
    assert results[(W2, "disk")].data["image_bytes"] is None
