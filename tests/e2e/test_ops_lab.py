"""exec, submit and dashboard on the real 3-host lab (real sshd, Docker, Ray with token auth).

The cluster is brought up once for the module. The dashboard tests run while the head's lab host drops
every connection to the dashboard port that does not come from the host itself (iptables in its network
namespace), so they prove the SSH tunnel: the operator cannot reach the dashboard directly.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raycluster_cli import inventory, state

from .conftest import IP1, IP2, IP3, UNUSED_IP, Lab

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
    assert "in json mode" in err  # logs go to stderr under --json
    assert token not in out + err


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
    command = [sys.executable, "-m", "raycluster_cli.cli", "dashboard", "-i", cluster.inventory, "--port", "0"]
    process = subprocess.Popen([*command, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        text = ""
        deadline = time.monotonic() + 120
        while not text.endswith("}\n") and time.monotonic() < deadline:
            text += process.stdout.readline()
        doc = json.loads(text)
        assert doc["ok"] is True and doc["url"].startswith("http://127.0.0.1:")
        request = urllib.request.Request(doc["url"] + "/api/jobs/", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(doc["url"] + "/api/jobs/", timeout=30)
        assert refused.value.code == 401  # the token is still needed through the tunnel
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
