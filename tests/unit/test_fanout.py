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
