"""exec, submit and dashboard on the real 3-host lab (real sshd, Docker, Ray with token auth).

The cluster is brought up once for the module. The dashboard tests run while the head's lab host drops
every connection to the dashboard port that does not come from the host itself (iptables in its network
namespace), so they prove the SSH tunnel: the operator cannot reach the dashboard directly.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from raycluster_cli.config import inventory, state

from .conftest import IP1, IP2, IP3, UNUSED_IP, Lab
from .faults import dashboard

pytestmark = pytest.mark.lab
DROP_DASHBOARD = "INPUT -i eth0 -p tcp --dport 8265 -j DROP"


def _cli(the_lab: Lab, *args: str, inventory_path: str | None = None, timeout: float = 600) -> tuple[int, str, str]:
    """`raycluster VERB -i INV [--json] … -- CMD` with the options before the command, as a real process."""
    verb, rest = args[0], list(args[1:])
    command = [sys.executable, "-m", "raycluster_cli.cli", verb, "-i", inventory_path or the_lab.inventory, *rest]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout, done.stderr


@pytest.fixture(scope="module")
def cluster(lab_hosts: Lab) -> Iterator[Lab]:
    # One `up`, no second try: a Ray node that misses its 30 s to register on a loaded machine (what a retry
    # here used to hide) is started once more by `up` itself (verbs/up_phases.py), as a user's `up` does.
    code, doc, err = lab_hosts.cli("up", timeout=1500)
    assert code == 0, err
    assert all(n["alive"] for n in doc["nodes"]), doc["nodes"]
    yield lab_hosts


@pytest.fixture
def token(cluster: Lab) -> str:
    return state.token_file(inventory.load(cluster.inventory).inventory).read_text().strip()


@pytest.fixture
def dashboard_blocked(cluster: Lab) -> Iterator[None]:
    """The operator cannot reach the head's dashboard: its lab host drops port 8265 from outside."""
    cluster.sh("lab-h1", f"iptables -I {DROP_DASHBOARD}")
    try:
        with pytest.raises(OSError), socket.create_connection((IP1, 8265), timeout=3):
            pass
        yield
    finally:
        cluster.sh("lab-h1", f"iptables -D {DROP_DASHBOARD}")


# exec ----------------------------------------------------------------------------------------------


def test_exec_runs_in_the_heads_container_with_the_node_env_and_its_exit_code(cluster: Lab) -> None:
    code, out, err = _cli(cluster, "exec", "--", 'echo "$(hostname) $NCCL_SOCKET_IFNAME"; ray --version; exit 7')
    assert code == 7, err
    lines = out.splitlines()
    assert lines[0] == "lab-h1 eth0"  # NCCL_SOCKET_IFNAME comes from the env file `up` wrote, not docker exec
    assert "2.60.0" in lines[1]


def test_exec_on_every_host_prefixes_lines_and_collects_json(cluster: Lab) -> None:
    code, out, _ = _cli(cluster, "exec", "--all", "--", "hostname; echo oops >&2")
    assert code == 0
    assert sorted(out.splitlines()) == [
        f"{ip:<15} | {name}" for ip, name in ((IP1, "lab-h1"), (IP2, "lab-h2"), (IP3, "lab-h3"))
    ]
    code, out, _ = _cli(cluster, "exec", "--json", "--host", IP2, "--host", IP3, "--", 'test "$(hostname)" = lab-h2')
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and doc["rc"] == 1
    assert [(h["host"], h["rc"]) for h in doc["hosts"]] == [(IP2, 0), (IP3, 1)]


def test_exec_reports_a_host_it_cannot_reach_as_255_and_the_others_still_run(cluster: Lab, tmp_path: Path) -> None:
    def edit(data: dict[str, Any]) -> None:
        data["ssh"]["connect_timeout_s"] = 3
        data["hosts"].append({"address": UNUSED_IP, "role": "worker"})

    variant = cluster.variant(tmp_path / "inventory.yaml", edit)
    code, out, _ = _cli(cluster, "exec", "--json", "--all", "--", "true", inventory_path=variant)
    doc = json.loads(out)
    assert code == 255
    by_host = {h["host"]: h for h in doc["hosts"]}
    assert [by_host[ip]["rc"] for ip in (IP1, IP2, IP3)] == [0, 0, 0]
    assert by_host[UNUSED_IP]["rc"] == 255 and UNUSED_IP in by_host[UNUSED_IP]["error"]


# submit --------------------------------------------------------------------------------------------


def test_submit_through_ssh_uploads_the_working_dir_streams_logs_and_returns_the_drivers_code(
    cluster: Lab, dashboard_blocked: None, token: str, tmp_path: Path
) -> None:
    (tmp_path / "job.py").write_text(
        "import sys, ray\nray.init()\n"
        "print('alive nodes', sum(n['Alive'] for n in ray.nodes()))\n"
        "from helper import VALUE\nprint('helper', VALUE)\nsys.exit(int(sys.argv[1]))\n"
    )
    (tmp_path / "helper.py").write_text("VALUE = 'from the working dir'\n")
    code, out, err = _cli(cluster, "submit", "--working-dir", str(tmp_path), "--", "python", "job.py", "7")
    assert code == 7, err
    assert "alive nodes 3" in out and "helper from the working dir" in out  # the job's log, streamed to stdout
    assert "FAILED" in err and "driver exit code 7" in err
    assert token not in out + err
    code, out, err = _cli(cluster, "submit", "--json", "--", "python", "-c", "print('in json mode')")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] is True and doc["job"]["status"] == "SUCCEEDED", err
    assert doc["job"]["logs_via"] == "tail"
    assert "in json mode" in err  # logs go to stderr under --json
    assert token not in out + err
    # --no-wait: exit 0 once Ray accepted the job; the cluster holds it (a second one of that ID is refused)
    no_wait = ("submit", "--no-wait", "--json", "--submission-id", "raycluster-no-wait", "--", "python", "-c", "1")
    code, out, err = _cli(cluster, *no_wait)
    doc = json.loads(out)
    assert code == 0 and doc["ok"] is True, err
    assert doc["job"]["status"] == "PENDING"
    # Ray's own job client on the head holds a job of that ID with the entrypoint given (it raises for an unknown ID)
    ask = (
        "from ray.job_submission import JobSubmissionClient as C; "
        f"i = C('http://{IP1}:8265').get_job_info('raycluster-no-wait'); print(i.submission_id, '|', i.entrypoint)"
    )
    held = cluster.sh("lab-h1", f'docker exec raycluster-lab-head python -c "{ask}"')
    assert held.strip().splitlines()[-1] == "raycluster-no-wait | python -c 1", held
    code, out, err = _cli(cluster, *no_wait)
    assert code == 1 and json.loads(out)["ok"] is False, err


def test_submit_streams_the_log_through_the_dashboards_tail_while_the_job_runs(
    cluster: Lab, dashboard_blocked: None, tmp_path: Path
) -> None:
    """The job prints a line, then waits for a marker file that the test writes only after that line came
    through: the log is streamed while the job runs, whatever the machine's speed."""
    marker = f"/tmp/raycluster-go-{os.getpid()}"
    containers = [
        ("lab-h1", "raycluster-lab-head"),
        ("lab-h2", "raycluster-lab-worker"),
        ("lab-h3", "raycluster-lab-worker"),
    ]
    (tmp_path / "job.py").write_text(
        "import os, time\nprint('waiting for the marker', flush=True)\n"
        f"end = time.time() + 300\nwhile not os.path.exists({marker!r}) and time.time() < end:\n    time.sleep(0.2)\n"
        f"print('marker seen' if os.path.exists({marker!r}) else 'no marker', flush=True)\n"
    )
    command = [sys.executable, "-m", "raycluster_cli.cli", "submit", "-i", cluster.inventory, "--json"]
    command += ["--working-dir", str(tmp_path), "--", "python", "job.py"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(400, process.kill)  # a hung submit fails the test, never the session
    watchdog.start()
    try:
        assert process.stderr is not None
        before = []
        for line in process.stderr:
            before.append(line)
            if "waiting for the marker" in line:
                break
        assert "waiting for the marker" in "".join(before), "".join(before)
        for hostname, container in containers:  # wherever the driver runs, the marker is there
            cluster.sh(hostname, f"docker exec {container} touch {marker}")
        out, rest = process.communicate(timeout=300)
        doc = json.loads(out)
        assert process.returncode == 0 and doc["job"]["status"] == "SUCCEEDED", rest
        assert doc["job"]["logs_via"] == "tail"  # Ray's WebSocket tail, not the whole log polled
        assert "marker seen" in rest and "waiting for the marker" not in rest  # each piece once
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()
        for hostname, container in containers:
            cluster.sh_result(hostname, f"docker exec {container} rm -f {marker}")


def test_submit_with_a_wrong_token_is_refused(cluster: Lab, token: str, tmp_path: Path) -> None:
    state_dir = tmp_path / "state" / "lab"
    state_dir.mkdir(parents=True)
    (state_dir / "auth-token").write_text("0" * 64)
    env = {**os.environ, "RAYCLUSTER_STATE_DIR": str(tmp_path / "state")}
    command = [sys.executable, "-m", "raycluster_cli.cli", "submit", "-i", cluster.inventory, "--json", "--", "true"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    doc = json.loads(done.stdout)
    assert done.returncode == 1 and "refused the cluster's token" in doc["error"]["message"]


# dashboard -----------------------------------------------------------------------------------------


def test_dashboard_forwards_a_local_port_until_ctrl_c(cluster: Lab, dashboard_blocked: None, token: str) -> None:
    with dashboard(cluster.inventory) as (process, doc):
        assert doc["ok"] is True and doc["url"].startswith("http://127.0.0.1:")
        request = urllib.request.Request(doc["url"] + "/api/jobs/", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(doc["url"] + "/api/jobs/", timeout=30)
        assert refused.value.code == 401  # the token is still needed through the tunnel
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=10) == 0


# metrics and status --watch -------------------------------------------------------------------------


def test_metrics_writes_scraped_targets_on_the_fixed_port_and_rays_dashboards(cluster: Lab, tmp_path: Path) -> None:
    out = tmp_path / "metrics"
    code, doc, err = cluster.cli("metrics", "--out", str(out))
    assert code == 0, (doc, err)
    nodes = {t["host"]: t for t in doc["targets"] if t["host"]}
    assert {h: t["target"] for h, t in nodes.items()} == {ip: f"{ip}:8080" for ip in (IP1, IP2, IP3)}
    assert all(t["up"] and t["samples"] > 10 and t["in_ray_list"] for t in nodes.values())
    written = json.loads((out / "prometheus" / "lab.json").read_text())
    assert {g["targets"][0] for g in written} >= {f"{ip}:8080" for ip in (IP1, IP2, IP3)}
    assert all(g["labels"]["ray_cluster"] == "lab" for g in written)
    dashboards = sorted(p.name for p in (out / "grafana" / "dashboards").glob("*.json"))
    assert dashboards == doc["dashboards"] and any("default" in name for name in dashboards)
    json.loads((out / "grafana" / "dashboards" / dashboards[0]).read_text())  # a real Grafana dashboard
    # The operator itself reaches a target too (what a Prometheus next to it would scrape).
    with urllib.request.urlopen(f"http://{IP2}:8080/metrics", timeout=30) as response:
        assert b"ray_" in response.read()


# ProxyJump and ~/.ssh/config ----------------------------------------------------------------------


@pytest.fixture
def workers_behind_h1(cluster: Lab) -> Iterator[None]:
    """lab-h2 and lab-h3 accept SSH only from lab-h1 (iptables in their network namespaces)."""
    rule = f"INPUT -p tcp --dport 22 ! -s {IP1} -j DROP"
    for name in ("lab-h2", "lab-h3"):
        cluster.sh(name, f"iptables -I {rule}")
    try:
        yield
    finally:
        for name in ("lab-h2", "lab-h3"):
            cluster.sh_result(name, f"iptables -D {rule}")


def _hostnames(doc: dict[str, Any]) -> dict[str, str]:
    return {h["host"]: h["stdout"].strip() or h["error"] for h in doc["hosts"]}


def test_proxy_jump_reaches_workers_that_accept_ssh_only_from_the_jump_host(
    cluster: Lab, workers_behind_h1: None, tmp_path: Path
) -> None:
    def direct(data: dict[str, Any]) -> None:
        data["ssh"]["connect_timeout_s"] = 3

    code, out, _ = _cli(
        cluster,
        "exec",
        "--json",
        "--all",
        "--",
        "hostname",
        inventory_path=cluster.variant(tmp_path / "d.yaml", direct),
    )
    assert code == 255 and set(_hostnames(json.loads(out))) == {IP1, IP2, IP3}
    assert _hostnames(json.loads(out))[IP1] == "lab-h1"

    def jump(data: dict[str, Any]) -> None:
        direct(data)
        data["ssh"]["proxy_jump"] = f"root@{IP1}"
        data["hosts"][0]["ssh"] = {"proxy_jump": "none"}

    code, out, err = _cli(
        cluster, "exec", "--json", "--all", "--", "hostname", inventory_path=cluster.variant(tmp_path / "j.yaml", jump)
    )
    assert code == 0, (out, err)
    assert _hostnames(json.loads(out)) == {IP1: "lab-h1", IP2: "lab-h2", IP3: "lab-h3"}


def test_ssh_config_proxyjump_alias_and_the_jump_hosts_key_is_verified(
    cluster: Lab, workers_behind_h1: None, tmp_path: Path
) -> None:
    data = yaml.safe_load(cluster.info.inventory_path.read_text())
    key, known = data["ssh"]["key"], data["ssh"]["known_hosts_file"]
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host bastion\n  HostName {IP1}\n  User root\n  IdentityFile {key}\n"
        f"Host {IP2} {IP3}\n  ProxyJump bastion\n  ConnectTimeout 3\n"
    )

    def use_config(data: dict[str, Any]) -> None:
        data["ssh"]["config_file"] = str(config)

    via_config = cluster.variant(tmp_path / "c.yaml", use_config)
    code, out, err = _cli(
        cluster, "exec", "--json", "--host", IP2, "--host", IP3, "--", "hostname", inventory_path=via_config
    )
    assert code == 0, (out, err)
    assert _hostnames(json.loads(out)) == {IP2: "lab-h2", IP3: "lab-h3"}
    # The jump host's key is checked like any other: without it in known_hosts, nothing goes through it.
    without_bastion = tmp_path / "known_hosts"
    without_bastion.write_text(
        "".join(line for line in Path(known).read_text().splitlines(True) if not line.startswith(f"{IP1} "))
    )

    def strict(data: dict[str, Any]) -> None:
        use_config(data)
        data["ssh"]["known_hosts_file"] = str(without_bastion)

    code, out, _ = _cli(
        cluster,
        "exec",
        "--json",
        "--host",
        IP2,
        "--",
        "hostname",
        inventory_path=cluster.variant(tmp_path / "s.yaml", strict),
    )
    error = json.loads(out)["hosts"][0]["error"]
    assert code == 255 and IP1 in error and "host key" in error.lower()


# Last: it stops a worker container (the next module brings the cluster up again).


def test_status_watch_redraws_until_ctrl_c_and_shows_a_stopped_worker(cluster: Lab) -> None:
    import pty

    master, slave = pty.openpty()
    command = [sys.executable, "-m", "raycluster_cli.cli", "status", "-i", cluster.inventory, "--watch"]
    process = subprocess.Popen(
        [*command, "--interval", "1"], stdout=slave, stderr=slave, env={**os.environ, "COLUMNS": "160"}
    )
    os.close(slave)
    seen = b""

    def read_until(marker: bytes, timeout: float) -> bool:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while marker not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1)
            if ready:
                seen += os.read(master, 65536)
        return marker in seen

    try:
        assert read_until(b"3/3 nodes alive", 180), seen[-2000:]
        cluster.sh("lab-h3", "docker stop -t 2 raycluster-lab-worker")
        assert read_until(b"exited", 120), seen[-2000:]
        assert seen.count(b"Ctrl-C to stop") >= 2 and b"\x1b[" in seen  # redrawn in place, several times
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)
