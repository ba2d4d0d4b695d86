import threading

from raycluster_cli.transport.base import put_command, quote
from raycluster_cli.transport.fanout import fanout


def test_every_item_gets_its_result_or_error_in_order() -> None:
    def work(n: int) -> int:
        if n == 2:
            raise ValueError("two")
        return n * 10

    results = fanout([1, 2, 3], work)
    assert [k for k, _ in results] == [1, 2, 3]
    assert results[0][1].value == 10 and results[2][1].value == 30
    assert isinstance(results[1][1].error, ValueError)


def test_runs_in_parallel_bounded() -> None:
    barrier = threading.Barrier(3, timeout=5)
    assert all(o.ok for _, o in fanout(range(3), lambda _: barrier.wait()))


def test_put_command_keeps_data_off_the_command_line() -> None:
    command = put_command("/etc/raycluster/demo/auth-token", 0o600)
    assert "umask 077" in command and "chmod 600" in command and "cat >" in command
    assert quote("a b", "c") == "'a b' c"


def test_group_result_names_every_failed_host_not_only_the_first() -> None:
    import pytest

    from raycluster_cli.errors import GroupError, TransportError

    class Host:
        def __init__(self, address: str) -> None:
            self.address = address

    hosts = [Host("192.0.2.1"), Host("192.0.2.2"), Host("192.0.2.3")]

    def work(host: Host) -> str:
        if host.address != "192.0.2.2":
            raise TransportError(host.address, "no answer on port 22 within 3s", "check the host")
        return "ok"

    result = fanout(hosts, work, what="start the workers")
    assert [h.address for h, _ in result] == ["192.0.2.1", "192.0.2.2", "192.0.2.3"]  # pairs, as before
    assert [h.address for h, _ in result.succeeded] == ["192.0.2.2"] and result.values() == ["ok"]
    assert [h.address for h, _ in result.failed] == ["192.0.2.1", "192.0.2.3"] and not result.ok
    assert result.messages()[0] == ("192.0.2.1", "no answer on port 22 within 3s")
    with pytest.raises(GroupError) as caught:
        result.raise_failures()
    message = caught.value.message
    assert message.startswith("2 host(s) failed to start the workers: ")
    assert "192.0.2.1: no answer" in message and "192.0.2.3: no answer" in message
    assert "192.0.2.1: 192.0.2.1" not in message  # the host is named once
    assert caught.value.hint == "check the host"
    assert [d["host"] for d in caught.value.details()] == ["192.0.2.1", "192.0.2.3"]


def test_queued_work_never_starts_after_an_interrupt() -> None:
    import pytest

    from raycluster_cli import cancel

    started: list[int] = []

    def work(n: int) -> int:
        started.append(n)
        if n == 0:
            cancel.request()  # Ctrl-C arrives while the first item runs
        return n

    try:
        result = fanout(range(5), work, max_workers=1)
    finally:
        cancel.reset()
    assert started == [0]
    assert result[0][1].value == 0
    assert all(isinstance(o.error, cancel.Cancelled) for _, o in result[1:])
    with pytest.raises(KeyboardInterrupt):
        result.raise_failures()
