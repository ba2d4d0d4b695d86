"""`exec`: host choice, the command built, the container check, per-host results and the worst exit code."""

from __future__ import annotations

import shlex

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.config.inventory import HostConfig
from raycluster_cli.errors import TransportError, UsageError
from raycluster_cli.transport import CommandResult, Transport
from raycluster_cli.transport.fake import FakeTransport
from raycluster_cli.verbs.execute import NOT_RUN, choose_hosts, container_problem, exec_command, run_exec, worst

from .conftest import EXAMPLE

INV = inventory.parse(EXAMPLE)
HEAD, W1, W2 = INV.hosts


def test_default_is_the_head_and_all_is_every_host() -> None:
    assert choose_hosts(INV, None, False) == [HEAD]
    assert choose_hosts(INV, None, True) == INV.hosts
    assert choose_hosts(INV, ["192.0.2.13", "192.0.2.12", "192.0.2.13"], False) == [W2, W1]


def test_unknown_host_and_both_flags_are_usage_errors() -> None:
    with pytest.raises(UsageError, match=r"192\.0\.2\.99 is not in the inventory"):
        choose_hosts(INV, ["192.0.2.99"], False)
    with pytest.raises(UsageError, match="exclude each other"):
        choose_hosts(INV, ["192.0.2.12"], True)


def test_command_sources_the_node_env_and_runs_the_words_in_a_shell() -> None:
    command = exec_command(INV, W1, ["echo", "$FOO", "|", "wc", "-c"], tag="t1")
    argv = shlex.split(command)
    at = argv.index("exec")
    assert argv[at - 1 : at + 4] == ["docker", "exec", "raycluster-demo-worker", "sh", "-c"]
    inner = shlex.split(argv[at + 4])
    at = inner.index("-w") - 1
    assert inner[at : at + 4] == ["setsid", "-w", "sh", "-c"]
    script = inner[at + 4].removesuffix(";")  # shlex joins the `;` that follows the quote
    assert script.startswith("echo $$ >/tmp/.raycluster-exec-t1; ")
    assert "if [ -r /run/raycluster/env ]; then set -a; . /run/raycluster/env; set +a; fi; " in script
    assert script.endswith("echo $FOO | wc -c")
    assert "trap " in command and "TERM HUP" in command  # the stop: tests/unit/test_exec_stop.py


@pytest.mark.parametrize(
    ("stdout", "rc", "problem"),
    [
        ("running demo/head", 0, ""),
        ("exited demo/head", 0, "is exited"),
        ("running other/head", 0, "not started by this cluster"),
        ("", 1, "no container raycluster-demo-head"),
    ],
)
def test_container_problem(stdout: str, rc: int, problem: str) -> None:
    found = container_problem(INV, HEAD, stdout, rc)
    assert (problem in found) if problem else found == ""


def _connect(tables: dict[str, FakeTransport | Exception]):  # type: ignore[no-untyped-def]
    def connect(host: HostConfig) -> Transport:
        value = tables[str(host.address)]
        if isinstance(value, Exception):
            raise value
        return value

    return connect


def test_results_per_host_and_lines_to_the_sink_and_the_worst_code() -> None:
    ok = FakeTransport("192.0.2.11", {"docker inspect": "running demo/head\n", "docker exec": "one\ntwo\n"})
    failing = FakeTransport(
        "192.0.2.12",
        {"docker inspect": "running demo/worker\n", "docker exec": CommandResult(3, "", "boom\n")},
    )
    connect = _connect({"192.0.2.11": ok, "192.0.2.12": failing, "192.0.2.13": TransportError("192.0.2.13", "down")})
    lines: list[tuple[str, str, str]] = []
    results = run_exec(INV, connect, INV.hosts, ["ray", "status"], on_output=lambda *a: lines.append(a))
    assert [(r.host, r.rc) for r in results] == [("192.0.2.11", 0), ("192.0.2.12", 3), ("192.0.2.13", NOT_RUN)]
    assert results[2].error.startswith("192.0.2.13: down")
    assert ("192.0.2.11", "stdout", "two") in lines and ("192.0.2.12", "stderr", "boom") in lines
    assert worst(results) == NOT_RUN
    assert worst(results[:2]) == 3 and worst(results[:1]) == 0


def test_no_command_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="no command"):
        run_exec(INV, _connect({}), [HEAD], [], on_output=lambda *a: None)


def test_a_missing_container_is_not_run() -> None:
    empty = FakeTransport("192.0.2.11", {"docker inspect": CommandResult(1, "", "No such object")})
    results = run_exec(INV, _connect({"192.0.2.11": empty}), [HEAD], ["true"], on_output=lambda *a: None)
    assert results[0].rc == NOT_RUN and "raycluster up" in results[0].error
    assert not any(c.startswith("docker exec") for c in empty.commands)


def test_an_engine_that_refuses_is_named_with_its_message() -> None:
    said = "permission denied while trying to connect to the Docker daemon socket at unix:///var/run/docker.sock"
    problem = container_problem(INV, HEAD, "", 1, said + "\n")
    assert problem.startswith("cannot ask the container engine on 192.0.2.11: permission denied")
    assert "run `raycluster up`" in container_problem(INV, HEAD, "", 1, "Error: No such object: x\n")
