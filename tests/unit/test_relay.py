"""image/relay.py with fake hosts: the staged copies are removed also after Ctrl-C (before, the clean-up went
through the fan-out, which starts nothing once the run is cancelled, so multi-GB files stayed on the hosts)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raycluster_cli import cancel
from raycluster_cli.config.inventory import parse
from raycluster_cli.delivery import relay
from raycluster_cli.delivery.deliver import image_job
from raycluster_cli.delivery.schedule import Delivery
from raycluster_cli.transport import CommandResult
from raycluster_cli.transport.fake import FakeTransport

A = "sha256:" + "a" * 64


class Guarded(FakeTransport):
    """A fake host whose commands stop at the cancellation flag, as the SSH transport's do; its receive command
    is where Ctrl-C lands."""

    def run(self, command: str, **options: Any) -> CommandResult:
        cancel.check(f"running a command on {self.host}")
        return super().run(command, **options)

    def feed(self, command: str, source: Any, **options: Any) -> CommandResult:
        cancel.request()  # the operator pressed Ctrl-C while the archive was on its way
        raise cancel.Cancelled("interrupted")


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    cancel.reset()
    yield
    cancel.reset()


def test_after_ctrl_c_every_host_still_removes_its_staged_copy(tmp_path: Path) -> None:
    inv = parse("cluster: t\nimage: img:1\nhosts:\n  - {address: 192.0.2.10, role: head}\n  - {address: 192.0.2.11}\n")
    archive = tmp_path / f"{A[7:19]}.tar.zst"
    archive.write_bytes(b"z" * 100)
    table: dict[str, CommandResult | str] = {re.escape(relay.TOOLS_COMMAND): "bash\ntimeout\nsha256sum\n", "": ""}
    hosts = {a: Guarded(a, table) for a in ("192.0.2.10", "192.0.2.11")}
    plan = [Delivery(a, "missing", "stream") for a in hosts]
    with pytest.raises(KeyboardInterrupt):
        relay.relay(
            inv,
            lambda h: hosts[str(h.address)],
            plan,
            lambda tools: image_job("img:1", A, archive, "zstd", "d" * 64),
            lambda e: None,
        )
    assert cancel.requested()  # the run was interrupted, and yet:
    for host in hosts.values():
        assert f"rm -f -- /var/tmp/raycluster-images/{A[7:19]}.tar.zst " in host.commands[-1], host.commands
