"""Checks × hosts through the runner, with hosts faked by a table of command → output."""

import json
import time
from pathlib import Path

import pytest

from raycluster_cli.checks import ALL_CHECKS, Status, ignore_ids, run_checks
from raycluster_cli.config import inventory
from raycluster_cli.config.inventory import HostConfig
from raycluster_cli.errors import TransportError, UsageError
from raycluster_cli.transport.base import CommandResult
from raycluster_cli.transport.fake import FakeTransport

RECORDED = Path(__file__).parent / "recorded"
IMAGE_ID = "sha256:" + "ab" * 32
# The host's one reading of each engine thing (host/engine_facts.py), and the other commands of the gather.
ENGINE = r"^if i=\$\(docker info"
IMAGE = r"^i=\$\(docker image inspect"
CONTAINERS = r"^docker ps --all"
PORTS = r"^ss -ltnH"  # listening ports, iptables, nft (both ports checks judge it, with CONTAINERS)
PROCESSES = r"^ps -eo pid=,args="
ETC_HOSTS = r"^h=; read -r h"  # the host's name, ---, /etc/hosts
CLOCK = r'^echo "\$s0"$'  # the batch's start, as the host's clock read it
STATE_DIR = r'^echo "user '
# A 6 GB host: Ray's default object store (30 %) fits the example's 2g /dev/shm.
MEMINFO = "MemTotal:        6000000 kB\nMemFree:          500000 kB\nMemAvailable:    5000000 kB\n"
DISK_LAB = (RECORDED / "disk_lab.txt").read_text().split("---\n")  # root, df, meminfo, image size
RUNTIMES = '{"io.containerd.runc.v2":{"path":"runc"},"runc":{"path":"runc"}}'


def engine(
    version: str = "24.0.7", root: str = "/var/lib/docker", df: str = DISK_LAB[1], runtimes: str = RUNTIMES
) -> str:
    """What the engine fact prints: `docker info`'s version, folder and runtimes, `---`, df of folder and /tmp."""
    return f"{version}\n{root}\n{runtimes.strip()}\n---\n{df}"


def image(ident: str = IMAGE_ID, size: int = 1984499298, versions: str = "python 3.11.2\nray 2.60.0\n") -> str:
    """What the image fact prints: `docker image inspect`'s ID and size, `---`, the versions inside it."""
    return f"{ident} {size}\n---\n{versions}"


NO_IMAGE = CommandResult(1, "no-image\n", "Error: No such image: raycluster/node:0.1.0")


def ps_json(*rows: tuple[str, str, str, dict[str, str]]) -> str:
    """Docker's `docker ps --format '{{json .}}'`: one object a line (ID, Names, State, Image, Labels)."""
    return "".join(
        json.dumps({"ID": i, "Names": n, "State": s, "Image": "raycluster/node:0.1.0", "Labels": labels_text(lb)})
        + "\n"
        for i, n, s, lb in rows
    )


def labels_text(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def disk_tables(text: str) -> dict[str, CommandResult | str]:
    """The engine, meminfo and image answers that give the disk check the sections root, df, meminfo, size."""
    root, df, meminfo, size = ([*text.split("---\n"), "", "", ""])[:4]
    found = image(size=int(size)) if size.strip().isdigit() else NO_IMAGE
    return {ENGINE: engine(root=root.strip(), df=df), r"^cat /proc/meminfo": meminfo, IMAGE: found}


def healthy(address: str, name: str, **overrides: CommandResult | str) -> dict[str, CommandResult | str]:
    table: dict[str, CommandResult | str] = {
        r"^true$": "",
        ENGINE: engine(),
        IMAGE: image(),
        CONTAINERS: "",
        r"^ip -o -4 addr show": f"2: eth0    inet {address}/24 brd 192.0.2.255 scope global eth0\n",
        r"^ip route get": f"192.0.2.11 dev eth0 src {address} uid 0\n    cache\n",
        ETC_HOSTS: f"{name}\n---\n127.0.0.1 localhost\n{address} {name}\n",
        PORTS: "LISTEN 0 128 0.0.0.0:22 0.0.0.0:*\n---\n-P INPUT ACCEPT\n---\n",
        CLOCK: f"{time.time():.9f}\n",
        r"^cat /proc/meminfo": MEMINFO,
        PROCESSES: "    1 /sbin/init\n  212 sshd: /usr/sbin/sshd -D\n---\n",
        STATE_DIR: "user root 0\ndir /etc/raycluster/demo\nat /etc/raycluster root 755 directory\nwritable yes\n"
        "sudo unused\n",
    }
    table.update(overrides)
    return table


def run(example_yaml: str, tables: dict[str, dict[str, CommandResult | str]], ignore: str | None = None) -> list:
    inv = inventory.parse(example_yaml)

    def connect(host: HostConfig) -> FakeTransport:
        address = str(host.address)
        if address not in tables:
            raise TransportError(address, "connection refused on port 22", "start sshd on the host")
        return FakeTransport(address, tables[address])

    return run_checks(inv, connect, ignore=ignore_ids(ignore))


def fleet(**per_host: dict[str, CommandResult | str]) -> dict[str, dict[str, CommandResult | str]]:
    tables = {f"192.0.2.1{i}": healthy(f"192.0.2.1{i}", f"node-{i}") for i in (1, 2, 3)}
    for address, table in per_host.items():
        tables[address] = table
    return tables


def failures(results: list) -> list[tuple[str, str]]:
    return [(r.host, r.id) for r in results if r.status == Status.FAIL]


def test_healthy_fleet_passes(example_yaml: str) -> None:
    results = run(example_yaml, fleet())
    assert failures(results) == []
    assert {(r.host, r.id) for r in results} >= {
        ("192.0.2.11", "head-address"),
        ("192.0.2.12", "route-to-head"),
    }
    assert not any(r.id == "head-address" and r.host != "192.0.2.11" for r in results)


def test_loopback_hostname_fails_on_that_host_only(example_yaml: str) -> None:
    debian = (RECORDED / "etc_hosts_debian_default.txt").read_text()
    tables = fleet(**{"192.0.2.12": healthy("192.0.2.12", "gpu-node-2", **{ETC_HOSTS: f"gpu-node-2\n---\n{debian}"})})
    results = run(example_yaml, tables)
    assert failures(results) == [("192.0.2.12", "etc-hosts")]
    bad = next(r for r in results if r.status == Status.FAIL)
    assert "127.0.1.1" in bad.message
    assert "192.0.2.12 gpu-node-2" in bad.hint


def test_missing_and_wrong_hostname(example_yaml: str) -> None:
    tables = fleet(
        **{
            "192.0.2.12": healthy("192.0.2.12", "n2", **{ETC_HOSTS: "n2\n---\n127.0.0.1 localhost\n"}),
            "192.0.2.13": healthy("192.0.2.13", "n3", **{ETC_HOSTS: "n3\n---\n192.0.2.99 n3\n"}),
        }
    )
    results = {(r.host, r.id): r for r in run(example_yaml, tables)}
    assert "does not name n2" in results[("192.0.2.12", "etc-hosts")].message
    assert "to 192.0.2.99, not 192.0.2.13" in results[("192.0.2.13", "etc-hosts")].message


def test_head_address_not_on_head(example_yaml: str) -> None:
    ip_out = (RECORDED / "ip_addr_multi_nic.txt").read_text().replace("192.0.2.11", "192.0.2.111")
    tables = fleet(**{"192.0.2.11": healthy("192.0.2.11", "node-1", **{r"^ip -o -4 addr show": ip_out})})
    results = run(example_yaml, tables)
    assert failures(results) == [("192.0.2.11", "head-address")]
    message = next(r.message for r in results if r.status == Status.FAIL)
    assert "198.51.100.11 (ib0)" in message


def test_worker_leaves_from_another_nic(example_yaml: str) -> None:
    route = "192.0.2.11 via 198.51.100.1 dev ib0 src 198.51.100.13 uid 0\n"
    tables = fleet(**{"192.0.2.13": healthy("192.0.2.13", "node-3", **{r"^ip route get": route})})
    results = run(example_yaml, tables)
    assert failures(results) == [("192.0.2.13", "route-to-head")]


def test_docker_down_and_permission(example_yaml: str) -> None:
    down = CommandResult(1, "", "Cannot connect to the Docker daemon at unix:///var/run/docker.sock.")
    denied = CommandResult(1, "", "permission denied while trying to connect to the Docker daemon socket")
    tables = fleet(
        **{
            "192.0.2.12": healthy("192.0.2.12", "node-2", **{ENGINE: down}),
            "192.0.2.13": healthy("192.0.2.13", "node-3", **{ENGINE: denied}),
        }
    )
    results = {(r.host, r.id): r for r in run(example_yaml, tables)}
    assert "systemctl start docker" in results[("192.0.2.12", "docker")].hint
    assert "usermod -aG docker" in results[("192.0.2.13", "docker")].hint


def test_image_missing_and_different(example_yaml: str) -> None:
    missing = NO_IMAGE
    tables = fleet(
        **{
            "192.0.2.12": healthy("192.0.2.12", "node-2", **{IMAGE: missing}),
            "192.0.2.13": healthy("192.0.2.13", "node-3", **{IMAGE: image("sha256:" + "cd" * 32)}),
        }
    )
    results = run(example_yaml, tables)
    assert sorted(failures(results)) == [("192.0.2.12", "image"), ("192.0.2.13", "image-same")]


def test_unreachable_host_does_not_hide_others(example_yaml: str) -> None:
    tables = fleet()
    del tables["192.0.2.12"]
    results = run(example_yaml, tables)
    assert failures(results) == [("192.0.2.12", "ssh")]
    assert all(r.status == Status.SKIP for r in results if r.host == "192.0.2.12" and r.id != "ssh")
    assert any(r.host == "192.0.2.13" and r.id == "etc-hosts" and r.status == Status.OK for r in results)


def test_ignore_demotes_named_failures(example_yaml: str) -> None:
    tables = fleet()
    del tables["192.0.2.12"]
    results = run(example_yaml, tables, ignore="ssh")
    assert failures(results) == []
    assert any(r.status == Status.WARN and r.id == "ssh" for r in results)
    assert failures(run(example_yaml, tables, ignore="all")) == []


def test_ignore_rejects_unknown_ids() -> None:
    with pytest.raises(UsageError, match="nosuch"):
        ignore_ids("etc-hosts,nosuch")
    assert ignore_ids(None) == frozenset()


def test_a_crashing_check_becomes_a_failure(example_yaml: str) -> None:
    tables = fleet(**{"192.0.2.12": healthy("192.0.2.12", "node-2", **{ETC_HOSTS: CommandResult(0, "", "")})})
    results = run(example_yaml, tables)
    assert ("192.0.2.12", "etc-hosts") in failures(results)


def test_port_taken_on_head(example_yaml: str) -> None:
    taken = "LISTEN 0 4096 0.0.0.0:6379 0.0.0.0:*\n---\n"
    tables = fleet(**{"192.0.2.11": healthy("192.0.2.11", "node-1", **{PORTS: taken})})
    results = run(example_yaml, tables)
    assert failures(results) == [("192.0.2.11", "ports-free")]
    bad = next(r for r in results if r.status == Status.FAIL)
    assert "6379 (GCS" in bad.message and "ss -ltnp" in bad.hint


def test_ports_held_by_our_running_head_are_fine(example_yaml: str) -> None:
    listening = "LISTEN 0 4096 0.0.0.0:6379 0.0.0.0:*\n---\n"
    head = {"io.raycluster.cluster": "demo", "io.raycluster.role": "head"}
    ours = ps_json(("3f2a9c", "raycluster-demo-head", "running", head))
    tables = fleet(**{"192.0.2.11": healthy("192.0.2.11", "node-1", **{PORTS: listening, CONTAINERS: ours})})
    assert failures(run(example_yaml, tables)) == []
    # ...but not when that container has stopped, nor when it is another cluster's.
    stopped = ps_json(("3f2a9c", "raycluster-demo-head", "exited", head))
    other = ps_json(("3f2a9c", "raycluster-x-head", "running", {**head, "io.raycluster.cluster": "x"}))
    for containers in (stopped, other):
        tables = fleet(**{"192.0.2.11": healthy("192.0.2.11", "node-1", **{PORTS: listening, CONTAINERS: containers})})
        assert failures(run(example_yaml, tables)) == [("192.0.2.11", "ports-free")]


def test_a_run_limited_to_some_hosts_checks_only_those_and_no_cross_host_check(example_yaml: str) -> None:
    inv = inventory.parse(example_yaml)
    tables = fleet()
    tables["192.0.2.12"] = healthy("192.0.2.12", "node-2", **{IMAGE: image("sha256:" + "cd" * 32)})
    runtime = [c for c in ALL_CHECKS if c.id == "image-runtime"]
    results = run_checks(
        inv, lambda h: FakeTransport(str(h.address), tables[str(h.address)]), runtime, hosts={"192.0.2.13"}
    )
    assert {(r.host, r.id) for r in results} == {("192.0.2.13", "ssh"), ("192.0.2.13", "image-runtime")}
    assert all(r.status == Status.OK for r in results)


class FreezesAfter(FakeTransport):
    """A host that accepted the connection, then stops answering: its one batch of checks meets its deadline."""

    def run(self, command: str, *, stdin: bytes | None = None, timeout: float | None = 120.0) -> CommandResult:
        self.round_trips += 1
        raise TransportError(self.host, "the host stopped answering (no reply to keepalives for 3s)", "check it")


def test_a_host_that_stops_answering_fails_once_and_its_other_checks_are_skipped(example_yaml: str) -> None:
    inv = inventory.parse(example_yaml)
    frozen: list[FreezesAfter] = []

    def connect(host: HostConfig) -> FakeTransport:
        address = str(host.address)
        if address == "192.0.2.13":
            frozen.append(FreezesAfter(address, healthy(address, "node-3")))
            return frozen[0]
        return FakeTransport(address, healthy(address, f"node-{address[-1]}"))

    results = [r for r in run_checks(inv, connect) if r.host == "192.0.2.13"]
    failed = [r for r in results if r.status == Status.FAIL]
    assert len(failed) == 1 and "stopped answering" in failed[0].message and "192.0.2.13" not in failed[0].message
    assert all(r.status == Status.SKIP for r in results[results.index(failed[0]) + 1 :] if r.id != "image-same")
    assert frozen[0].round_trips == 1  # no further command was tried on the frozen host
