"""What a check is and what it returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from raycluster_cli.host.facts import Fact, HostContext
from raycluster_cli.transport import CommandResult


class Status(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True)
class CheckResult:
    id: str
    host: str
    status: Status
    message: str
    hint: str = ""
    data: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        return data


@dataclass(frozen=True)
class Finding:
    """What a parser concludes; the runner adds the check id and the host."""

    status: Status
    message: str
    hint: str = ""
    data: dict[str, Any] = field(default_factory=dict)


CheckContext = HostContext


@dataclass(frozen=True)
class Check:
    """Judges one fact gathered on the host: `parse(rc, stdout, stderr, ctx)` decides, without I/O.

    The fact's command runs in the host's one batch of the verb (see facts.py); a `timed` fact's stdout
    starts with a line `operator <sent> <received>`: the operator's clock around the batch.
    """

    id: str
    title: str
    fact: Fact[CommandResult]
    parse: Callable[[int, str, str, CheckContext], Finding]
    applies: Callable[[CheckContext], bool] = lambda ctx: True
