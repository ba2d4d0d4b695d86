"""Exit codes, one-line errors and the JSON document of every verb, without a lab.

The only connections made are to 127.0.0.1 on a port nobody listens on (refused at once).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from raycluster_cli import checks
from raycluster_cli.cli import app as cli
from raycluster_cli.cli import lifecycle
from raycluster_cli.errors import ExitCode

runner = CliRunner()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def refused_inventory(tmp_path: Path) -> Path:
    """A one-host inventory whose SSH port refuses connections."""
    path = tmp_path / "inventory.yaml"
    path.write_text(
        "cluster: t\nimage: raycluster/node:0.1.0\n"
        f"ssh: {{port: {free_port()}, key: null, known_hosts_file: {tmp_path / 'kh'}, connect_timeout_s: 3, "
        "connect_retries: 0}\n"
        "hosts:\n  - {address: 127.0.0.1, role: head}\n"
    )
    return path


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(cli.app, list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("verb", ["doctor", "up", "down", "bench", "status", "logs"])
def test_missing_inventory_is_a_usage_error(verb: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAYCLUSTER_INVENTORY", raising=False)
    code, out, err = invoke(verb)
    assert code == ExitCode.USAGE
    assert out == ""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "inventory.yaml not found" in lines[0] and "fix:" in lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("verb", ["doctor", "up", "down", "bench", "status", "logs"])
def test_json_error_document(verb: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: t\nimage: x\nhosts:\n  - {address: 192.0.2.1, role: head, typo: 1}\n")
    code, out, _ = invoke(verb, "-i", str(bad), "--json")
    assert code == ExitCode.USAGE
    doc = json.loads(out)
    assert doc["schema_version"] == 1 and doc["ok"] is False
    assert "hosts[0].typo" in doc["error"]["message"]
    assert doc["error"]["hint"]


def test_unknown_flag_is_a_usage_error() -> None:
    code, _, _ = invoke("doctor", "--no-such-flag")
    assert code == ExitCode.USAGE


def test_negative_prefill_chunk_is_a_usage_error_naming_the_flag(refused_inventory: Path) -> None:
    code, out, err = invoke("bench", "-i", str(refused_inventory), "--prefill-chunk", "-1")
    assert code == ExitCode.USAGE
    assert out == "" and "--prefill-chunk" in err and "Traceback" not in err


def test_unknown_ignore_id_is_a_usage_error(refused_inventory: Path) -> None:
    code, _, err = invoke("doctor", "-i", str(refused_inventory), "--ignore", "nosuch")
    assert code == ExitCode.USAGE
    assert "nosuch" in err


def test_doctor_unreachable_host_fails_with_json(refused_inventory: Path) -> None:
    code, out, _ = invoke("doctor", "-i", str(refused_inventory), "--json")
    assert code == ExitCode.FAILED
    doc = json.loads(out)
    assert doc["ok"] is False and doc["schema_version"] == 1
    ssh = next(c for c in doc["checks"] if c["id"] == "ssh")
    assert set(ssh) >= {"id", "host", "status", "message", "hint"}
    assert ssh["host"] == "127.0.0.1" and ssh["status"] == "fail"
    assert "refused" in ssh["message"] and ssh["hint"]


def test_doctor_ignore_all_turns_failure_into_warning(refused_inventory: Path) -> None:
    code, out, _ = invoke("doctor", "-i", str(refused_inventory), "--json", "--ignore", "all")
    assert code == ExitCode.OK
    assert json.loads(out)["ok"] is True


@pytest.mark.parametrize("local_image", [None, "sha256:" + "ab" * 32], ids=["no-image-here", "image-here"])
def test_up_refuses_on_failed_preflight(
    refused_inventory: Path, monkeypatch: pytest.MonkeyPatch, local_image: str | None
) -> None:
    # Whether this machine has the node image must not matter: SSH failing is the cause to report.
    monkeypatch.setattr("raycluster_cli.verbs.up_phases.local_image_id", lambda _: local_image)
    code, out, _ = invoke("up", "-i", str(refused_inventory), "--json")
    assert code == ExitCode.FAILED
    doc = json.loads(out)
    assert doc["ok"] is False and "preflight" in doc["error"]["message"]
    assert "127.0.0.1 ssh: connection refused" in doc["error"]["message"]
    assert "image" not in doc["error"]["message"]
    assert any(c["status"] == "fail" and c["id"] == "ssh" for c in doc["checks"])


def test_down_unreachable_host_reports_it(refused_inventory: Path) -> None:
    code, out, _ = invoke("down", "-i", str(refused_inventory), "--json")
    assert code == ExitCode.FAILED
    doc = json.loads(out)
    assert doc["removed"] == [] and doc["errors"][0]["host"] == "127.0.0.1"


def test_interrupt_exits_130(refused_inventory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(checks, "run_checks", interrupted)
    code, _, err = invoke("doctor", "-i", str(refused_inventory))
    assert code == ExitCode.INTERRUPTED
    assert "interrupted" in err


def test_unexpected_error_is_one_line_without_debug(refused_inventory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(checks, "run_checks", broken)
    code, _, err = invoke("doctor", "-i", str(refused_inventory))
    assert code == ExitCode.FAILED
    assert "boom" in err and "Traceback" not in err
    result = runner.invoke(cli.app, ["doctor", "-i", str(refused_inventory), "--debug"])
    assert isinstance(result.exception, RuntimeError)


def test_env_var_inventory(refused_inventory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYCLUSTER_INVENTORY", str(refused_inventory))
    code, out, _ = invoke("doctor", "--json")
    assert code == ExitCode.FAILED
    assert json.loads(out)["cluster"] == "t"


def test_version() -> None:
    code, out, _ = invoke("version")
    assert code == 0 and out.strip() == "0.1.0"


def test_doctor_unknown_network_tool_is_a_usage_error(refused_inventory: Path) -> None:
    code, _, err = invoke("doctor", "-i", str(refused_inventory), "--network", "--network-tool", "netperf")
    assert code == ExitCode.USAGE
    assert "netperf" in err and "builtin" in err


def test_doctor_network_with_an_unreachable_host_still_answers(refused_inventory: Path) -> None:
    code, out, _ = invoke("doctor", "-i", str(refused_inventory), "--network", "--json")
    assert code == ExitCode.FAILED
    doc = json.loads(out)
    assert [c["id"] for c in doc["checks"] if c["status"] == "fail"] == ["ssh"]


def test_status_unreachable_host_is_degraded_exit_1(refused_inventory: Path) -> None:
    code, out, _ = invoke("status", "-i", str(refused_inventory), "--json")
    assert code == ExitCode.FAILED
    doc = json.loads(out)
    assert doc["ok"] is False and doc["state"] == "down"
    (host,) = doc["hosts"]
    assert host["container"] == "unreachable" and "refused" in host["error"]
    assert doc["totals"] == {"hosts": 1, "alive_nodes": 0, "resources": {}}


def test_logs_unknown_host_is_a_usage_error(refused_inventory: Path, tmp_path: Path) -> None:
    code, out, _ = invoke(
        "logs", "-i", str(refused_inventory), "--host", "192.0.2.99", "--out", str(tmp_path), "--json"
    )
    assert code == ExitCode.USAGE
    assert "192.0.2.99" in json.loads(out)["error"]["message"]


def test_logs_unreachable_host_fails_naming_it(refused_inventory: Path, tmp_path: Path) -> None:
    code, out, _ = invoke("logs", "-i", str(refused_inventory), "--out", str(tmp_path / "l"), "--json")
    assert code == ExitCode.FAILED
    (host,) = json.loads(out)["hosts"]
    assert host["host"] == "127.0.0.1" and "refused" in host["error"]


def test_up_insecure_warns_on_stderr_before_anything(refused_inventory: Path) -> None:
    code, out, err = invoke("up", "-i", str(refused_inventory), "--insecure", "--json")
    assert code == ExitCode.FAILED  # the host refuses SSH: preflight fails
    assert "warning" in err and "authentication is OFF" in err
    assert json.loads(out)["ok"] is False


def test_next_steps_name_the_token_file_not_the_token() -> None:
    steps = lifecycle._next_steps("192.0.2.11", 6379, "http://192.0.2.11:8265", "/state/demo/auth-token", "inv.yaml")
    assert steps["ray_address"] == "192.0.2.11:6379"
    assert steps["submit_job"].startswith("RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=/state/demo/auth-token ray job")
    assert "--address http://192.0.2.11:8265" in steps["submit_job"]
    assert steps["status"] == "raycluster status -i inv.yaml"
    insecure = lifecycle._next_steps("192.0.2.11", 6379, "http://192.0.2.11:8265", None, None)
    assert insecure["submit_job"].startswith("ray job submit") and insecure["logs"] == "raycluster logs"


@pytest.mark.parametrize("kind", ["missing", "directory"])
@pytest.mark.parametrize("where", ["ssh", "host"])
def test_a_bad_key_path_is_one_usage_line_naming_ssh_key(tmp_path: Path, kind: str, where: str) -> None:
    key = tmp_path / "keys" if kind == "directory" else tmp_path / "no-such-key"
    if kind == "directory":
        key.mkdir()
    ssh = f"ssh: {{key: {key}}}\n" if where == "ssh" else ""
    host_ssh = f", ssh: {{key: {key}}}" if where == "host" else ""
    path = tmp_path / "inventory.yaml"
    path.write_text(f"cluster: t\nimage: x\n{ssh}hosts:\n  - {{address: 192.0.2.1, role: head{host_ssh}}}\n")
    code, out, err = invoke("doctor", "-i", str(path))
    assert code == ExitCode.USAGE and out == ""
    lines = [line for line in err.splitlines() if line.strip()]
    field = "ssh.key" if where == "ssh" else "hosts[0].ssh.key"
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in err
    assert ("does not exist" if kind == "missing" else "is a directory") in lines[0]
