"""Remote commands per host per verb on the real lab: every paramiko `exec_command` counted (issue 11 item 2)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import paramiko
import pytest

from raycluster_cli.checks import Status, run_checks
from raycluster_cli.config import inventory
from raycluster_cli.progress import HostPhase
from raycluster_cli.transport.pool import SSHPool
from raycluster_cli.verbs.up import up

from .conftest import Lab

pytestmark = pytest.mark.lab


@pytest.fixture
def exec_counts(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Every command any SSH channel executes, counted by the peer's address."""
    counts: Counter[str] = Counter()
    real = paramiko.Channel.exec_command

    def counted(channel: paramiko.Channel, command: Any) -> None:
        counts[channel.get_transport().getpeername()[0]] += 1  # type: ignore[union-attr]
        real(channel, command)

    monkeypatch.setattr(paramiko.Channel, "exec_command", counted)
    yield counts


def test_doctor_runs_at_most_four_remote_commands_per_host(lab_hosts: Lab, exec_counts: Counter[str]) -> None:
    inv = inventory.load(lab_hosts.inventory).inventory
    pool = SSHPool(inv)
    try:
        results = run_checks(inv, pool)
    finally:
        pool.close()
    assert not [r for r in results if r.status == Status.FAIL], results
    assert set(exec_counts) == {str(h.address) for h in inv.hosts}
    print(f"doctor: remote commands per host {dict(exec_counts)}")
    assert max(exec_counts.values()) <= 4, exec_counts


def test_up_runs_at_most_eight_remote_commands_per_worker(lab_hosts: Lab, exec_counts: Counter[str]) -> None:
    """Issue 11 item 2: from a stopped cluster to every node joined, ≤ 8 remote commands per worker."""
    code, _, err = lab_hosts.cli("down")
    assert code == 0, err
    exec_counts.clear()
    inv = inventory.load(lab_hosts.inventory).inventory
    pool = SSHPool(inv)
    events: list[object] = []
    try:
        result = up(inv, pool, progress=events.append)
    finally:
        pool.close()
        lab_hosts.cli("down")
    assert result.ok, [n.to_dict() for n in result.nodes]
    print(f"up: remote commands per host {dict(exec_counts)}")
    assert max(exec_counts[str(w.address)] for w in inv.workers) <= 8, exec_counts
    joined = [e for e in events if isinstance(e, HostPhase) and e.phase == "joined"]
    assert sorted(e.host for e in joined) == sorted(str(h.address) for h in inv.hosts)
    assert max(e.joined for e in joined) == len(inv.hosts)
