"""Pure logic of up/down/status/logs: image plans, node decisions, diagnosis, status, error counting."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from pathlib import Path

import pytest

from raycluster_cli.checks import CheckResult, Status
from raycluster_cli.checks.cross import demote_fixed_image_checks, image_ids_found
from raycluster_cli.config import inventory
from raycluster_cli.delivery.deliver import ImageTransfer, plan_transfers
from raycluster_cli.errors import InventoryError, OperationError, TransportError
from raycluster_cli.host.containers import LABEL_CLUSTER, LABEL_CONFIG, LABEL_ROLE, Container, config_hash, run_argv
from raycluster_cli.host.diagnose import Evidence, diagnose, evidence_command, parse_evidence
from raycluster_cli.host.node import decide, node_env
from raycluster_cli.transport import CommandResult
from raycluster_cli.transport.fake import FakeTransport
from raycluster_cli.verbs.logs import count_errors
from raycluster_cli.verbs.status import HostStatus, StatusResult, host_command, merge_nodes, parse_host

from .conftest import EXAMPLE

A = "sha256:" + "a" * 64
B = "sha256:" + "b" * 64
HOSTS = ("192.0.2.11", "192.0.2.12", "192.0.2.13")


def _inv(extra: str = "") -> inventory.Inventory:
    return inventory.parse(EXAMPLE + extra)


def _image_checks(ids: dict[str, str | None]) -> list[CheckResult]:
    return [
        CheckResult("image", h, Status.OK, "present", data={"image_id": i})
        if i
        else CheckResult("image", h, Status.FAIL, "missing", "hint")
        for h, i in ids.items()
    ]


# image distribution ------------------------------------------------------------------------------


def test_stream_plan_names_missing_and_different_hosts_only() -> None:
    plan = plan_transfers(_inv(), A, {HOSTS[0]: A, HOSTS[1]: None, HOSTS[2]: B})
    assert [(t.host, t.method) for t in plan] == [(HOSTS[1], "stream"), (HOSTS[2], "stream")]
    assert plan[0].reason == "missing"
    assert "different image ID bbbbbbbbbbbb (here: aaaaaaaaaaaa)" in plan[1].reason


def test_stream_plan_is_empty_when_every_host_has_this_machines_image() -> None:
    assert plan_transfers(_inv(), A, dict.fromkeys(HOSTS, A)) == []


def test_stream_without_a_local_image_fails_with_a_hint_only_when_needed() -> None:
    assert plan_transfers(_inv(), None, dict.fromkeys(HOSTS, A)) == []
    with pytest.raises(OperationError) as info:
        plan_transfers(_inv(), None, {HOSTS[0]: A, HOSTS[1]: None, HOSTS[2]: A})
    assert HOSTS[1] in info.value.message and "not in this machine's Docker engine" in info.value.message
    assert "image_source: pull" in info.value.hint


def test_pull_plan_pulls_where_missing_and_everywhere_when_hosts_disagree() -> None:
    inv = _inv("image_source: pull\n")
    assert [t.host for t in plan_transfers(inv, None, {HOSTS[0]: A, HOSTS[1]: None, HOSTS[2]: A})] == [HOSTS[1]]
    assert [t.host for t in plan_transfers(inv, A, {HOSTS[0]: A, HOSTS[1]: B, HOSTS[2]: A})] == list(HOSTS)
    assert all(t.method == "pull" for t in plan_transfers(inv, None, {HOSTS[0]: None}))


def test_unreachable_hosts_are_not_planned() -> None:
    assert plan_transfers(_inv(), A, {HOSTS[0]: A}) == []


def test_up_demotes_the_image_checks_it_is_about_to_fix() -> None:
    checks = _image_checks({HOSTS[0]: A, HOSTS[1]: None, HOSTS[2]: B})
    checks.append(CheckResult("image-same", HOSTS[2], Status.FAIL, "differs", "hint"))
    checks.append(CheckResult("docker", HOSTS[0], Status.FAIL, "dead", "hint"))
    plan = plan_transfers(_inv(), A, image_ids_found(checks))
    after = {(r.id, r.host): r for r in demote_fixed_image_checks(checks, {t.host for t in plan}, "streams")}
    assert after[("image", HOSTS[1])].status == Status.WARN
    assert after[("image", HOSTS[1])].message.endswith("(up streams it)")
    assert after[("image-same", HOSTS[2])].status == Status.WARN
    assert after[("docker", HOSTS[0])].status == Status.FAIL  # not about the image: still fails


def test_nothing_is_demoted_without_a_plan() -> None:
    checks = _image_checks({HOSTS[0]: None})
    assert demote_fixed_image_checks(checks, set(), "streams") == checks
    assert demote_fixed_image_checks(checks, {HOSTS[1]}, "streams")[0].status == Status.FAIL


# per-host settings and node decisions ------------------------------------------------------------

IP_ADDR = (
    "1: lo    inet 127.0.0.1/8 scope host lo\n"
    "2: eno1    inet 192.0.2.12/24 brd 192.0.2.255 scope global eno1\n"
    "3: docker0    inet 172.17.0.1/16 scope global docker0\n"
)


def test_node_env_derives_the_socket_interfaces_from_the_nic_holding_the_node_ip() -> None:
    inv = _inv("env: {A: one, NCCL_SOCKET_IFNAME: ib0}\n")
    env = node_env(inv, inv.hosts[1], IP_ADDR)
    assert env == {"A": "one", "NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eno1"}
    assert "GLOO_SOCKET_IFNAME" not in node_env(inv, inv.hosts[2], IP_ADDR)  # its IP is on no NIC listed


def test_host_env_overrides_cluster_env() -> None:
    text = EXAMPLE.replace("- {address: 192.0.2.12, role: worker}", "- {address: 192.0.2.12, env: {A: host}}")
    inv = inventory.parse(text + "env: {A: cluster, B: b}\n")
    assert inv.env_for(inv.hosts[1]) == {"A": "host", "B": "b"}
    assert inv.env_for(inv.hosts[2]) == {"A": "cluster", "B": "b"}


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ("env: {'1BAD': x}\n", "env"),
        ("image_source: ftp\n", "image_source"),
    ],
)
def test_bad_env_or_image_source_names_the_field(extra: str, field: str) -> None:
    with pytest.raises(InventoryError) as info:
        _inv(extra)
    assert field in info.value.message


def test_builtin_resources_are_refused() -> None:
    text = EXAMPLE.replace("- {address: 192.0.2.12, role: worker}", "- {address: 192.0.2.12, resources: {CPU: 4}}")
    with pytest.raises(InventoryError) as info:
        inventory.parse(text)
    assert "hosts[1].resources" in info.value.message and "num_cpus" in info.value.message


def _ours(inv: inventory.Inventory, index: int, state: str = "running", config: str | None = None) -> Container:
    host = inv.hosts[index]
    labels = {LABEL_CLUSTER: inv.cluster, LABEL_ROLE: host.role}
    labels[LABEL_CONFIG] = config if config is not None else config_hash(run_argv(inv, host))
    return Container("id", "name", state, inv.image, labels)


def test_decide_keeps_an_unchanged_running_container() -> None:
    inv = _inv()
    assert decide(_ours(inv, 1), inv, inv.hosts[1], "", (A, A), "d1", "d1") == ("keep", "")


@pytest.mark.parametrize(
    ("state", "force", "config", "ids", "seen", "reason"),
    [
        ("exited", "", None, (A, A), "d1", "container exited"),
        # the restart policy's back-off between two starts (a worker whose head is gone): `up` starts it afresh
        ("restarting", "", None, (A, A), "d1", "container restarting"),
        ("running", "the head was replaced", None, (A, A), "d1", "the head was replaced"),
        ("running", "", "0000", (A, A), "d1", "configuration changed"),
        ("running", "", None, (A, B), "d1", "image changed (aaaaaaaaaaaa → bbbbbbbbbbbb)"),
        ("running", "", None, (A, A), "d2", "env or auth token changed"),
        ("running", "", None, (A, A), None, "env or auth token changed"),
    ],
)
def test_decide_replaces_our_container_and_says_why(
    state: str, force: str, config: str | None, ids: tuple[str, str], seen: str | None, reason: str
) -> None:
    inv = _inv()
    action, why = decide(_ours(inv, 1, state, config), inv, inv.hosts[1], force, ids, seen, "d1")
    assert action == "replace"
    assert why.startswith(reason)


def test_plan_node_refuses_a_foreign_container_named_like_ours() -> None:
    from raycluster_cli.host.facts import HostContext
    from raycluster_cli.host.node import parse_container_view, plan_node

    inv = _inv()
    row = '{"ID":"f00","Names":"raycluster-demo-worker","State":"running","Image":"x","Labels":""}'
    other = '{"ID":"f01","Names":"raycluster-demo-worker-old","State":"exited","Image":"x","Labels":""}'
    ps = CommandResult(0, f"{other}\n{row}\n", "")
    ctx = HostContext(inv, inv.hosts[1])
    view = parse_container_view(ctx, [ps, CommandResult(0, A + "\n--raycluster--\nd1  -\n", "")])
    assert view.container is not None and view.container.id == "f00"
    assert view.image_id == A and view.files_digest == "d1"
    assert parse_container_view(ctx, [CommandResult(0, other + "\n", ""), CommandResult(0, "", "")]).container is None
    with pytest.raises(OperationError) as info:
        plan_node(inv, inv.hosts[1], view, A, "d1")
    assert "did not start" in info.value.message and "docker rm -f raycluster-demo-worker" in info.value.hint


# diagnosis of nodes that did not join ------------------------------------------------------------


def test_parse_evidence_of_a_running_container() -> None:
    text = (
        "lab-h3\n--raycluster--\nrunning 0\n--raycluster--\nyes\n--raycluster--\nno\n--raycluster--\nline 1\nline 2\n"
    )
    ev = parse_evidence(text)
    assert ev == Evidence("lab-h3", "running", 0, True, False, ["line 1", "line 2"])


def test_evidence_command_tests_the_gcs_from_inside_the_container() -> None:
    inv = _inv()
    command = evidence_command(inv, inv.hosts[2])
    assert "raycluster-demo-worker" in command and "192.0.2.11" in command and "6379" in command


def test_diagnosis_worker_registered_from_another_address() -> None:
    inv = _inv()
    nodes = [
        {"node_ip": "192.0.2.11", "alive": True, "hostname": "h1"},
        {"node_ip": "198.51.100.13", "alive": True, "hostname": "h3"},
    ]
    cause = diagnose(inv, inv.hosts[2], Evidence("h3", "running", 0, True, True, []), nodes)
    assert cause == "worker 192.0.2.13 (h3) registered from 198.51.100.13, inventory says 192.0.2.13"


def test_diagnosis_container_exited_shows_the_last_error() -> None:
    inv = _inv()
    logs = ["starting", "RuntimeError: could not bind", "bye"]
    cause = diagnose(inv, inv.hosts[1], Evidence("h2", "exited", 1, True, None, logs), [])
    assert cause == "worker 192.0.2.12 (h2): its container exited, exit code 1: RuntimeError: could not bind"


def test_diagnosis_oom_kill() -> None:
    inv = _inv()
    cause = diagnose(inv, inv.hosts[1], Evidence("h2", "exited", 137, True, None, []), [])
    assert "exit code 137: killed for lack of memory?" in cause


def test_diagnosis_missing_image_and_missing_container() -> None:
    inv = _inv()
    assert "image raycluster/node:0.1.0 is missing" in diagnose(inv, inv.hosts[1], Evidence("", "", None, False), [])
    assert "container is gone" in diagnose(inv, inv.hosts[1], Evidence("", "", None, True), [])


def test_diagnosis_unreachable_gcs_from_the_probe_or_the_log() -> None:
    inv = _inv()
    by_probe = diagnose(inv, inv.hosts[1], Evidence("h2", "running", 0, True, False, ["waiting"]), [])
    assert (
        by_probe
        == "worker 192.0.2.12 (h2): could not reach the head's GCS at 192.0.2.11:6379 (firewall, route or head address?)"
    )
    log = ["Failed to connect to GCS at address 192.0.2.11:6379 within 5 seconds."]
    assert "could not reach the head's GCS" in diagnose(
        inv, inv.hosts[1], Evidence("h2", "running", 0, True, None, log), []
    )


def test_diagnosis_still_starting() -> None:
    inv = _inv()
    cause = diagnose(inv, inv.hosts[1], Evidence("h2", "running", 0, True, True, ["Local node IP: 192.0.2.12"]), [])
    assert "has not registered" in cause


def test_two_missing_hosts_and_one_stranger_is_not_guessed() -> None:
    inv = _inv()
    nodes = [{"node_ip": "198.51.100.99", "alive": True, "hostname": "other"}]
    cause = diagnose(inv, inv.hosts[1], Evidence("h2", "running", 0, True, True, []), nodes, missing_count=2)
    assert "registered from" not in cause


# status ------------------------------------------------------------------------------------------


def test_parse_host_status() -> None:
    inv = _inv()
    text = f"running {A} demo/worker\n--raycluster--\n2.60.0\n"
    st = parse_host(inv, inv.hosts[1], text)
    assert (st.container, st.image_id, st.ray_version) == ("running", A, "2.60.0")
    assert parse_host(inv, inv.hosts[1], "--raycluster--\n").container == "missing"
    assert parse_host(inv, inv.hosts[1], f"running {A} /\n--raycluster--\n").container == "foreign"
    assert "raycluster-demo-worker" in host_command(inv, inv.hosts[1])


def test_status_lists_the_models_each_host_holds() -> None:
    from raycluster_cli.render.lifecycle import _model_lines

    inv = _inv()
    digest = "0123456789abcdef" * 2
    text = f"running {A} demo/worker\n--raycluster--\n2.60.0\n--raycluster--\n{digest}\t4096\ttiny llama\n"
    st = parse_host(inv, inv.hosts[1], text)
    assert st.models == [{"digest": digest, "size": 4096, "name": "tiny llama"}]
    assert st.to_dict()["models"] == st.models
    assert parse_host(inv, inv.hosts[1], f"running {A} demo/worker\n--raycluster--\n2.60.0\n").models == []
    old = parse_host(inv, inv.hosts[2], f"--raycluster--\n--raycluster--\n{digest}\t-\t-\n")  # no .raycluster-model
    assert old.models == [{"digest": digest, "size": None, "name": ""}]
    hosts = [st.to_dict(), old.to_dict()]
    assert _model_lines(hosts) == [f"model tiny llama ({digest[:12]}, 0.0 MB) on 2/2: {HOSTS[1]}, {HOSTS[2]}"]
    assert "models/*/.raycluster-manifest" in host_command(inv, inv.hosts[1])


def test_status_merges_the_gcs_view_and_totals_only_healthy_nodes() -> None:
    hosts = [
        HostStatus(HOSTS[0], "head", HOSTS[0], "running"),
        HostStatus(HOSTS[1], "worker", HOSTS[1], "running"),
        HostStatus(HOSTS[2], "worker", HOSTS[2], "exited"),
    ]
    nodes = [
        {"node_ip": HOSTS[0], "alive": True, "resources": {"CPU": 2.0}},
        {"node_ip": HOSTS[1], "alive": False, "resources": {}},
        {"node_ip": HOSTS[1], "alive": True, "resources": {"CPU": 1.0, "special": 2.0}},
        {"node_ip": HOSTS[2], "alive": True, "resources": {"CPU": 1.0}},  # a ghost: its container is gone
    ]
    merge_nodes(hosts, nodes)
    result = StatusResult(hosts)
    assert [h.ray_node for h in hosts] == ["alive", "alive", "alive"]
    assert [h.healthy for h in hosts] == [True, True, False]
    assert result.state == "degraded"
    assert result.totals() == {"hosts": 3, "alive_nodes": 2, "resources": {"CPU": 3.0, "special": 2.0}}


def test_status_without_a_head() -> None:
    hosts = [HostStatus(HOSTS[0], "head", HOSTS[0], "missing")]
    merge_nodes(hosts, None)
    assert hosts[0].ray_node == "unknown"
    assert StatusResult(hosts).state == "down"


# logs --------------------------------------------------------------------------------------------


def test_count_errors() -> None:
    text = "ok\n[2026] ERROR worker.py:1 -- boom\nTraceback (most recent call last):\nValueError: x\nfine error-free\n"
    count, first = count_errors(text)
    assert count == 3
    assert first[0].endswith("boom")


def test_diagnosis_exited_because_the_gcs_was_unreachable() -> None:
    inv = _inv()
    log = ["ConnectionError: Failed to connect to GCS at 192.0.2.11:6379"]
    cause = diagnose(inv, inv.hosts[1], Evidence("h2", "exited", 1, True, None, log), [])
    assert cause.startswith("worker 192.0.2.12 (h2): its container exited, exit code 1: could not reach the head's GCS")


# distribution with fake hosts --------------------------------------------------------------------


def test_stream_sends_the_cached_archive_and_verifies_the_image_id(tmp_path: Path) -> None:
    from raycluster_cli.delivery.deliver import distribute
    from raycluster_cli.progress import TransferProgress

    inv = _inv()
    archive = tmp_path / "aaaaaaaaaaaa.tar.gz"
    archive.write_bytes(b"x" * 600_000)
    fake = FakeTransport(
        HOSTS[2], {"for t in zstd": "bash\ntimeout\nsha256sum\n", "docker load": f"Loaded image\n{A}\n", "rm -f": ""}
    )
    events: list[object] = []
    done = distribute(inv, lambda h: fake, [ImageTransfer(HOSTS[2], "missing", "stream")], A, tmp_path, events.append)
    assert [(t.host, t.method, t.codec, t.bytes_sent) for t in done] == [(HOSTS[2], "stream", "gzip", 600_000)]
    assert list(fake.fed.values()) == [archive.read_bytes()]
    command = next(iter(fake.fed))
    assert 'gzip -dc <"$a" | docker load -q' in command  # the archive, once its SHA-256 matched
    assert command.index("_sha ") < command.index("docker load")
    transfers = [e for e in events if isinstance(e, TransferProgress)]
    assert transfers[-1] == TransferProgress(HOSTS[2], 600_000, 600_000, done=True, label=f"image → {HOSTS[2]}")


def test_stream_fails_when_the_loaded_image_has_another_id(tmp_path: Path) -> None:
    from raycluster_cli.delivery.deliver import distribute

    (tmp_path / "aaaaaaaaaaaa.tar.gz").write_bytes(b"x")
    fake = FakeTransport(
        HOSTS[1], {"for t in zstd": "bash\ntimeout\nsha256sum\n", "docker load": f"Loaded image\n{B}\n", "rm -f": ""}
    )
    with pytest.raises(OperationError) as info:
        distribute(_inv(), lambda h: fake, [ImageTransfer(HOSTS[1], "missing", "stream")], A, tmp_path)
    assert HOSTS[1] in info.value.message and "expected aaaaaaaaaaaa" in info.value.message


def test_pull_runs_docker_pull_and_names_the_host_that_failed() -> None:
    from raycluster_cli.delivery.deliver import distribute

    inv = _inv("image_source: pull\n")
    good = FakeTransport(HOSTS[1], {"docker pull": "sha256:x"})
    bad = FakeTransport(HOSTS[2], {"docker pull": CommandResult(1, "", "denied: requested access")})
    hosts = {HOSTS[1]: good, HOSTS[2]: bad}
    plan = [ImageTransfer(HOSTS[1], "missing", "pull"), ImageTransfer(HOSTS[2], "missing", "pull")]
    with pytest.raises(OperationError) as info:
        distribute(inv, lambda h: hosts[str(h.address)], plan, None, Path("/nonexistent"))
    assert "1 host(s)" in info.value.message and HOSTS[2] in info.value.message and "denied" in info.value.message
    assert good.commands == ["docker pull -q raycluster/node:0.1.0"]


def test_files_digest_changes_with_env_and_token() -> None:
    from raycluster_cli.host.node import files_digest

    base = files_digest(b"A='1'\n", b"tok")
    assert base != files_digest(b"A='2'\n", b"tok")
    assert base != files_digest(b"A='1'\n", b"other")
    assert files_digest(b"A='1'\n", None) == files_digest(b"A='1'\n", b"")


# down --purge with fake hosts --------------------------------------------------------------------


def _purge_hosts(rmi: CommandResult) -> dict[str, FakeTransport]:
    table: dict[str, CommandResult | str] = {
        "docker ps": "",
        "docker image inspect": A,
        "docker rmi": rmi,
        r"^if \[ -e /etc/raycluster/demo \] \|\| \[ -L /etc/raycluster/demo \]; then \( f=/etc/raycluster/demo; .* "
        r"&& rm -rf -- /etc/raycluster/demo && echo removed; fi$": "removed\n",
        r"^if \[ -d /var/tmp/raycluster-images \] && \[ ! -L /var/tmp/raycluster-images \] && "
        r"\[ -O /var/tmp/raycluster-images \]; then rm -rf -- /var/tmp/raycluster-images": "removed\n",
    }
    return {h: FakeTransport(h, table) for h in HOSTS}


def test_down_purge_removes_image_host_files_and_local_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from raycluster_cli.config.state import ensure_token, state_dir
    from raycluster_cli.verbs.down import down

    monkeypatch.setenv("RAYCLUSTER_STATE_DIR", str(tmp_path))
    inv = _inv()
    ensure_token(inv)
    hosts = _purge_hosts(CommandResult(0, "Untagged", ""))
    result = down(inv, lambda h: hosts[str(h.address)], purge=True)
    assert result.ok and result.removed == []
    purged = {(p["host"], p["item"]) for p in result.purged}
    for host in HOSTS:
        assert (host, "image raycluster/node:0.1.0") in purged and (host, "/etc/raycluster/demo") in purged
        assert (host, "/var/tmp/raycluster-images") in purged  # the relay's staging folder (only if it is ours)
        assert any("rm -rf -- /etc/raycluster/demo &&" in c for c in hosts[host].commands)
    assert ("localhost", str(state_dir(inv))) in purged and not state_dir(inv).exists()
    kept = down(inv, lambda h: _purge_hosts(CommandResult(0, "", ""))[str(h.address)])
    assert kept.purged == []


def test_down_purge_keeps_the_local_token_while_a_host_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from raycluster_cli.config.state import ensure_token, state_dir
    from raycluster_cli.verbs.down import down

    monkeypatch.setenv("RAYCLUSTER_STATE_DIR", str(tmp_path))
    inv = _inv()
    ensure_token(inv)
    hosts = _purge_hosts(CommandResult(1, "", "conflict: unable to remove repository reference"))
    result = down(inv, lambda h: hosts[str(h.address)], purge=True)
    assert not result.ok
    assert {e["host"] for e in result.errors} == set(HOSTS) and "a container still uses it" in result.errors[0]["error"]
    assert state_dir(inv).exists()


# waiting for the nodes: one more start for a worker whose container exited -----------------------


class _Host(FakeTransport):
    """A fake host whose worker container exits on its first start and runs after the second."""

    def __init__(self, host: str, exits_first: bool, exits_always: bool = False) -> None:
        super().__init__(host, {})
        self.starts = 1
        self.exits_first = exits_first
        self.exits_always = exits_always

    def running(self) -> bool:
        return not (self.exits_always or (self.exits_first and self.starts == 1))

    def answer(self, command: str) -> CommandResult:
        self.commands.append(command)
        if "docker run" in command:
            self.starts += 1
            return CommandResult(0, "id", "")
        if command.startswith("end=$(("):  # waiting for its Ray node to register
            return CommandResult(0, "", "") if self.running() else CommandResult(3, "exited\n", "")
        return CommandResult(0, "", "")


class _Head(_Host):
    """A head whose probe waits, as the real one does, until the expected nodes are alive (or its timeout),
    and is ended by `cancel_probe` (exit 143, no document)."""

    def __init__(self, workers: dict[str, _Host]) -> None:
        super().__init__(HOSTS[0], False)
        self.workers = workers
        self.cancelled = threading.Event()

    def nodes(self) -> list[dict[str, object]]:
        return [{"node_ip": HOSTS[0], "node_id": "h", "alive": True}] + [
            {"node_ip": ip, "node_id": ip, "alive": w.running()} for ip, w in self.workers.items()
        ]

    def answer(self, command: str) -> CommandResult:
        if "raycluster_cli.host.probe" in command:
            expect = set(re.search(r"--expect (\S*)", command)[1].split(",")) - {"''"}  # type: ignore[index]
            end = time.monotonic() + float(re.search(r"--timeout (\d+)", command)[1])  # type: ignore[index]
            while not expect <= {n["node_ip"] for n in self.nodes() if n["alive"]} and time.monotonic() < end:
                if "raycluster-look-" in command and self.cancelled.wait(0.005):
                    return CommandResult(143, "", "")
            return CommandResult(0, json.dumps({"nodes": self.nodes()}), "")
        if "kill $(cat /tmp/raycluster-look-" in command:
            self.cancelled.set()
        return super().answer(command)


def _wait(workers: dict[str, _Host]) -> tuple[list[dict[str, object]], list[str], list[object]]:
    from raycluster_cli.verbs.up_hosts import NodesMissing
    from raycluster_cli.verbs.up_phases import UpRun

    inv = _inv()
    hosts: dict[str, FakeTransport] = {HOSTS[0]: _Head(workers), **workers}
    said: list[object] = []
    run = UpRun(inv, lambda h: hosts[str(h.address)], said.append, 60, frozenset())
    with contextlib.suppress(NodesMissing):
        run.wait()
    retried = [r.address for r in run.runs.values() if r.retried]
    return run.nodes, retried, [s for s in said if isinstance(s, str) and s != "waiting for every node to join"]


def test_a_worker_that_exited_while_starting_is_started_once_more() -> None:
    workers = {HOSTS[1]: _Host(HOSTS[1], False), HOSTS[2]: _Host(HOSTS[2], True)}
    nodes, retried, said = _wait(workers)
    assert retried == [HOSTS[2]]
    assert workers[HOSTS[2]].starts == 2 and workers[HOSTS[1]].starts == 1
    assert all(n["alive"] for n in nodes)
    assert said == [f"{HOSTS[2]}: the worker container exited while starting; starting it once more"]


def test_a_worker_that_exits_again_stops_the_wait_early() -> None:
    workers = {HOSTS[1]: _Host(HOSTS[1], False), HOSTS[2]: _Host(HOSTS[2], True, exits_always=True)}
    nodes, retried, _ = _wait(workers)
    assert retried == [HOSTS[2]] and workers[HOSTS[2]].starts == 2
    assert {n["node_ip"]: n["alive"] for n in nodes}[HOSTS[2]] is False


class _FlakyHead(_Head):
    """A head whose node list cannot be read the first `failures` times (a loaded raylet drops the driver)."""

    def __init__(self, workers: dict[str, _Host], failures: int) -> None:
        super().__init__(workers)
        self.failures = failures
        self.probes = 0

    def answer(self, command: str) -> CommandResult:
        if "raycluster_cli.host.probe" in command:
            self.probes += 1
            if self.probes <= self.failures:
                return CommandResult(1, "", "core_worker_process.cc:247: Failed to register worker to Raylet: IOError")
        return super().answer(command)


@pytest.mark.parametrize("failures", [1, 2, 3])
def test_a_node_list_the_head_could_not_give_is_asked_again_a_few_times(
    failures: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from raycluster_cli.errors import OperationError
    from raycluster_cli.verbs import up_look
    from raycluster_cli.verbs.up_phases import UpRun

    monkeypatch.setattr(up_look, "_PROBE_PAUSE_S", 0.0)
    workers = {HOSTS[1]: _Host(HOSTS[1], False), HOSTS[2]: _Host(HOSTS[2], False)}
    head = _FlakyHead(workers, failures)
    hosts: dict[str, FakeTransport] = {HOSTS[0]: head, **workers}
    said: list[object] = []
    run = UpRun(_inv(), lambda h: hosts[str(h.address)], said.append, 60, frozenset())
    if failures > up_look.PROBE_RETRIES:
        with pytest.raises(OperationError, match="cannot read the cluster's nodes: core_worker_process"):
            run.wait()
        assert head.probes == up_look.PROBE_RETRIES + 1
    else:
        run.wait()
        assert all(n["alive"] for n in run.nodes) and all(r.alive for r in run.runs.values())
        again = [s for s in said if isinstance(s, str) and "asking the head again" in s]
        assert len(again) == failures


class _Paused(_Host):
    """A worker whose container is paused (frozen): it still counts as running, its node never registers."""

    def answer(self, command: str) -> CommandResult:
        if command.startswith("end=$(("):  # the wait on the host ends by its own deadline: rc 4, timed out
            self.commands.append(command)
            return CommandResult(4, "(paused)\n", "")
        return super().answer(command)


class _FreezesOnRestart(_Host):
    """A worker whose container exited, and whose host stops answering when it is started again."""

    def run(self, command: str, *, stdin: bytes | None = None, timeout: float | None = 120.0) -> CommandResult:
        if "docker run" in command and self.starts > 1:
            raise TransportError(self.host, "the host stopped answering (nothing received for 6s)", "check it")
        return super().run(command, stdin=stdin, timeout=timeout)


def test_a_paused_worker_is_waited_for_never_replaced() -> None:
    workers = {HOSTS[1]: _Host(HOSTS[1], False), HOSTS[2]: _Paused(HOSTS[2], False)}
    nodes, retried, _ = _wait(workers)
    assert retried == [] and workers[HOSTS[2]].starts == 1
    assert not any("docker run" in c or "docker rm" in c for c in workers[HOSTS[2]].commands)
    assert {n["node_ip"] for n in nodes if n["alive"]} >= {HOSTS[0], HOSTS[1]}


def test_a_worker_whose_restart_fails_stays_missing_and_the_wait_goes_on() -> None:
    from raycluster_cli.verbs.up_hosts import NodesMissing
    from raycluster_cli.verbs.up_phases import UpRun

    workers = {HOSTS[1]: _Host(HOSTS[1], False), HOSTS[2]: _FreezesOnRestart(HOSTS[2], True, exits_always=True)}
    hosts: dict[str, FakeTransport] = {HOSTS[0]: _Head(workers), **workers}
    run = UpRun(_inv(), lambda h: hosts[str(h.address)], lambda _: None, 60, frozenset())
    with pytest.raises(NodesMissing) as caught:  # not a GroupError: the missing-nodes error names it
        run.wait()
    assert [r.address for r in run.runs.values() if r.retried] == [HOSTS[2]]
    assert [d["host"] for d in caught.value.details] == [HOSTS[2]]
    assert sorted(caught.value.joined) == sorted([HOSTS[0], HOSTS[1]])


def test_nodes_missing_names_the_missing_host_and_the_joined_ones() -> None:
    from raycluster_cli.verbs.up_hosts import NodesMissing
    from raycluster_cli.verbs.up_phases import UpRun

    frozen = HOSTS[2]
    workers = {HOSTS[1]: _Host(HOSTS[1], False), HOSTS[2]: _Host(HOSTS[2], False)}
    hosts: dict[str, FakeTransport] = {HOSTS[0]: _Head(workers), HOSTS[1]: workers[HOSTS[1]]}

    def connect(host: inventory.HostConfig) -> FakeTransport:
        if str(host.address) == frozen:
            raise TransportError(frozen, "the host stopped answering (nothing received for 6s)", "check it")
        return hosts[str(host.address)]

    run = UpRun(_inv(), connect, lambda _: None, 45, frozenset())  # type: ignore[arg-type]
    with pytest.raises(NodesMissing) as caught:
        run.wait()
    error = caught.value
    assert sorted(error.joined) == sorted([HOSTS[0], HOSTS[1]])
    assert [d["host"] for d in error.details] == [frozen]
    assert "did not join within 45s" in error.message and "stopped answering" in error.message
    assert error.hint == f"{frozen}: check it; then re-run `raycluster up`"


def test_the_node_list_is_read_from_an_older_images_probe_that_printed_rays_output_first() -> None:
    from raycluster_cli.host.node import probe

    document = json.dumps({"ok": True, "nodes": [{"node_ip": HOSTS[0], "node_id": "h", "alive": True}]})
    head = FakeTransport(
        HOSTS[0], {"raycluster_cli.host.probe": f"2026-11-30 INFO worker.py:1 -- Connecting\n{document}\n"}
    )
    assert [n["node_ip"] for n in probe(head, _inv(), [HOSTS[0]], 5)] == [HOSTS[0]]
    junk = FakeTransport(HOSTS[0], {"raycluster_cli.host.probe": "Traceback (most recent call last):\n"})
    with pytest.raises(OperationError, match="cannot read the cluster's nodes: Traceback"):
        probe(junk, _inv(), [HOSTS[0]], 5)


# the order of up's last phases: every worker's container starts while the head is still starting -------


class _Logged(_Host):
    """A host that notes each container start and registration wait in a log shared by all hosts."""

    def __init__(self, host: str, log: list[str], exits_first: bool = False, exits_always: bool = False) -> None:
        super().__init__(host, exits_first, exits_always)
        self.log = log

    def answer(self, command: str) -> CommandResult:
        if "docker run" in command:
            self.log.append(f"{self.host} run" + (" (replacing)" if "docker rm -f" in command else ""))
        elif command.startswith("end=$(("):
            self.log.append(f"{self.host} registered?")
        return super().answer(command)


class _LoggedHead(_Logged, _Head):
    def __init__(self, workers: dict[str, _Host], log: list[str], exits_first: bool = False, always: bool = False):
        _Head.__init__(self, workers)
        self.log, self.exits_first, self.exits_always = log, exits_first, always
        self.starts = 0  # its first container is the one `up` starts (exits_first: that one exits)


def _up_phases(head_exits_first: bool = False, head_exits_always: bool = False) -> tuple[list[str], object]:
    from raycluster_cli.verbs.up_phases import UpRun

    log: list[str] = []
    workers: dict[str, _Host] = {h: _Logged(h, log) for h in HOSTS[1:]}
    hosts: dict[str, FakeTransport] = {HOSTS[0]: _LoggedHead(workers, log, head_exits_first, head_exits_always)}
    hosts.update(workers)
    run = UpRun(_inv(), lambda h: hosts[str(h.address)], lambda _: None, 60, frozenset())
    run.start_head()
    run.start_workers()
    run.wait()
    return log, run


def test_every_worker_starts_before_the_head_is_registered_and_all_join() -> None:
    log, run = _up_phases()
    assert log[:3] == [f"{HOSTS[0]} run", f"{HOSTS[1]} run", f"{HOSTS[2]} run"] or log[:3] == [
        f"{HOSTS[0]} run",
        f"{HOSTS[2]} run",
        f"{HOSTS[1]} run",
    ]
    assert log[3] == f"{HOSTS[0]} registered?"
    assert all(r.alive for r in run.runs.values())  # type: ignore[attr-defined]


def test_a_head_started_once_more_makes_every_worker_join_again() -> None:
    log, run = _up_phases(head_exits_first=True)
    head_again = log.index(f"{HOSTS[0]} run (replacing)")
    assert log[head_again + 1] == f"{HOSTS[0]} registered?"  # the second head registered, then the workers again
    again = [line for line in log[head_again + 2 :] if line.endswith("(replacing)")]
    assert sorted(again) == [f"{HOSTS[1]} run (replacing)", f"{HOSTS[2]} run (replacing)"]
    reasons = {r.address: r.reason for r in run.runs.values()}  # type: ignore[attr-defined]
    assert reasons[HOSTS[1]] == reasons[HOSTS[2]] == "the head was started once more"
    assert all(r.alive for r in run.runs.values())  # type: ignore[attr-defined]


def test_a_head_that_does_not_start_fails_up_and_marks_the_workers() -> None:
    with pytest.raises(OperationError, match="the head container exited") as caught:
        _up_phases(head_exits_first=True, head_exits_always=True)
    assert caught.value.hint.startswith("see `docker logs raycluster-")


def test_a_failed_worker_ends_the_look_at_the_gcs_early() -> None:
    """The head's GCS is asked for every node while the workers register; one worker's failure ends that
    look at once (it would otherwise wait out the whole deadline) and the joined nodes are read again."""
    workers = {HOSTS[1]: _Host(HOSTS[1], False), HOSTS[2]: _Host(HOSTS[2], True, exits_always=True)}
    started = time.monotonic()
    nodes, _, _ = _wait(workers)
    assert time.monotonic() - started < 30  # the fake probe's deadline is 60 s
    assert {n["node_ip"]: n["alive"] for n in nodes} == {HOSTS[0]: True, HOSTS[1]: True, HOSTS[2]: False}


@pytest.mark.parametrize("running", ["true", "false"])
def test_the_registration_watch_under_a_real_shell(running: str, tmp_path: Path) -> None:
    """`started_command` under /bin/sh with a fake docker: the log says "Ray runtime started." on its fourth
    reading (exit 0, the state read every other time), or the container stopped (exit 3 with its log tail)."""
    import subprocess

    from raycluster_cli.host.node import EXITED, started_command

    inv = _inv()
    docker = tmp_path / "docker"
    docker.write_text(
        '#!/bin/sh\necho "$1" >> "$D/calls"\n'
        'case "$3" in *Pid*) exit 1;; esac\n'  # an engine without these fields: the loop asks docker
        'if [ "$1" = inspect ]; then echo "$RUNNING"; exit 0; fi\n'
        'n=$(grep -c "^logs" "$D/calls"); [ "$n" -ge 4 ] && echo "Ray runtime started."; echo "last line"\n'
    )
    docker.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "D": str(tmp_path), "RUNNING": running}
    done = subprocess.run(["/bin/sh", "-c", started_command(inv, inv.hosts[1], 30)], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    calls = (tmp_path / "calls").read_text().split()
    if running == "true":
        assert done.returncode == 0 and calls == ["inspect", "logs", "inspect", "logs", "logs", "inspect", "logs"]
    else:
        assert (
            done.returncode == EXITED and calls == ["inspect", "logs", "inspect", "logs"] and "last line" in done.stdout
        )


@pytest.mark.parametrize("alive", [True, False])
def test_the_registration_watch_reads_the_log_file_and_proc_without_the_engine(alive: bool, tmp_path: Path) -> None:
    """With the container's log file readable and its first process known, the loop runs no docker command
    while it waits: the file gets "Ray runtime started." after a second (exit 0); or the process is gone and the
    engine, asked once, says the container stopped (exit 3 with its log tail)."""
    import os
    import subprocess
    import threading

    from raycluster_cli.host.node import EXITED, started_command

    inv = _inv()
    log = tmp_path / "json.log"
    log.write_text('{"log":"starting\\n"}\n')
    gone = subprocess.run(["/bin/sh", "-c", "echo $$"], capture_output=True, text=True).stdout.strip()  # reaped
    pid = os.getpid() if alive else int(gone)
    docker = tmp_path / "docker"
    docker.write_text(
        '#!/bin/sh\necho "$1" >> "$D/calls"\n'
        'case "$3" in *Pid*) echo "$PID true $LOG"; exit 0;; esac\n'
        'if [ "$1" = inspect ]; then echo false; exit 0; fi\n'
        'echo "last line"\n'
    )
    docker.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "D": str(tmp_path), "PID": str(pid), "LOG": str(log)}
    threading.Timer(1.0, lambda: log.write_text(log.read_text() + '{"log":"Ray runtime started.\\n"}\n')).start()
    done = subprocess.run(["/bin/sh", "-c", started_command(inv, inv.hosts[1], 30)], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    calls = (tmp_path / "calls").read_text().split()
    if alive:
        assert done.returncode == 0 and calls == ["inspect"]  # one inspect, then only the file and /proc
    else:
        assert done.returncode == EXITED and calls == ["inspect", "inspect", "logs"] and "last line" in done.stdout


def test_the_registration_watch_does_not_trust_the_log_of_a_container_that_no_longer_runs(tmp_path: Path) -> None:
    """A container `up` kept has "Ray runtime started." in its log from its first start; if it exited since
    (the engine says Running false), the watch says exited (exit 3 with its log tail), not registered."""
    import subprocess

    from raycluster_cli.host.node import EXITED, started_command

    inv = _inv()
    log = tmp_path / "json.log"
    log.write_text('{"log":"Ray runtime started.\\n"}\n')
    docker = tmp_path / "docker"
    docker.write_text(
        '#!/bin/sh\necho "$1" >> "$D/calls"\ncase "$3" in *Pid*) echo "0 false $LOG"; exit 0;; esac\necho "last line"\n'
    )
    docker.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "D": str(tmp_path), "LOG": str(log)}
    done = subprocess.run(["/bin/sh", "-c", started_command(inv, inv.hosts[1], 30)], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == EXITED and "last line" in done.stdout, done
    assert (tmp_path / "calls").read_text().split() == ["inspect", "logs"]


def test_the_registration_watch_ends_when_the_container_stays_paused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paused container's first process stays in /proc and its log never moves: once the wait has lasted a
    while, the engine is asked whether it is paused; a pause seen once and then gone does not end the wait,
    one seen twice in a row does (exit 5 with the log tail), long before the deadline."""
    import os
    import subprocess

    from raycluster_cli.host import node as nodes

    monkeypatch.setattr(nodes, "_PAUSE_AFTER", 4)  # the turns before the first question, and between questions
    monkeypatch.setattr(nodes, "_PAUSE_EVERY", 2)
    inv = _inv()
    log = tmp_path / "json.log"
    log.write_text('{"log":"starting\\n"}\n')
    (tmp_path / "answers").write_text("true\nfalse\ntrue\ntrue\n")
    docker = tmp_path / "docker"
    docker.write_text(
        '#!/bin/sh\necho "$1 $3" >> "$D/calls"\n'
        'case "$3" in *Pid*) echo "$PID true $LOG"; exit 0;; '
        '*Paused*) head -n 1 "$D/answers"; sed -i 1d "$D/answers"; exit 0;; esac\n'
        'echo "last line"\n'
    )
    docker.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "D": str(tmp_path), "PID": str(os.getpid()), "LOG": str(log)}
    started = time.monotonic()
    done = subprocess.run(["/bin/sh", "-c", nodes.started_command(inv, inv.hosts[1], 60)], env=env,
                          capture_output=True, text=True, timeout=90)  # fmt: skip
    assert done.returncode == nodes.PAUSED and "last line" in done.stdout, done
    assert time.monotonic() - started < 30
    calls = (tmp_path / "calls").read_text().splitlines()
    assert sum("Paused" in c for c in calls) == 4 and (tmp_path / "answers").read_text() == ""
    error = nodes.start_failure(inv, inv.hosts[1], nodes.CommandResult(nodes.PAUSED, done.stdout, ""), 60)
    assert "is paused" in error.message and error.hint.startswith("run `docker unpause ")
    assert error.message.endswith("cannot register: last line")
    quiet = nodes.start_failure(inv, inv.hosts[1], nodes.CommandResult(nodes.PAUSED, "", ""), 60)
    assert quiet.message.endswith("so its Ray node cannot register")  # no "(no log)" after a paused start


def test_plan_node_refuses_our_cluster_running_with_another_token() -> None:
    """Issue 34, item 8: a second operator (another state folder, another token) must not replace the running
    cluster's containers; the same token, or none on either side (`--insecure`), plans as before."""
    from raycluster_cli.host.facts import HostContext
    from raycluster_cli.host.node import container_command, parse_container_view, plan_node, token_digest

    inv = _inv()
    theirs, mine = token_digest(b"their token"), token_digest(b"my token")
    assert theirs and mine and theirs != mine and token_digest(None) is None
    labels = "io.raycluster.cluster=demo,io.raycluster.role=worker"
    row = f'{{"ID":"f00","Names":"raycluster-demo-worker","State":"running","Image":"x","Labels":"{labels}"}}'
    ctx = HostContext(inv, inv.hosts[1])
    assert "sha256sum < /run/raycluster/auth-token" in container_command(ctx)
    answer = f"{A}\n--raycluster--\nd1  -\ntoken {theirs}  -\n"
    view = parse_container_view(ctx, [CommandResult(0, row + "\n", ""), CommandResult(0, answer, "")])
    assert (view.files_digest, view.token_digest) == ("d1", theirs)
    with pytest.raises(OperationError) as info:
        plan_node(inv, inv.hosts[1], view, A, "d2", token=mine)
    message = info.value.message
    assert message.startswith(f"{inv.hosts[1].address}: cluster demo's worker container there runs with another")
    assert theirs[:12] in message and mine[:12] in message and "their token" not in message
    assert "raycluster down" in info.value.hint and "/auth-token" in info.value.hint
    assert plan_node(inv, inv.hosts[1], view, A, "d1", token=theirs).action in ("keep", "replace")
    assert plan_node(inv, inv.hosts[1], view, A, "d2", token=None).action == "replace"  # --insecure
    no_token = parse_container_view(
        ctx, [CommandResult(0, row + "\n", ""), CommandResult(0, f"{A}\n--raycluster--\nd1  -\n", "")]
    )
    assert no_token.token_digest is None
    assert plan_node(inv, inv.hosts[1], no_token, A, "d2", token=mine).action == "replace"  # auth turned on
