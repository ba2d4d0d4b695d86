"""What a check is and what it returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from ..inventory import HostConfig, Inventory


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


@dataclass(frozen=True)
class CheckContext:
    inventory: Inventory
    host: HostConfig

    @property
    def address(self) -> str:
        return str(self.host.address)


@dataclass(frozen=True)
class Check:
    """`command(ctx)` runs on the host; `parse(rc, stdout, stderr, ctx)` decides, without I/O.

    A `timed` check's stdout starts with a line `operator <sent> <received>`: the operator's clock
    (epoch seconds) just before the command was sent and just after its output came back.
    """

    id: str
    title: str
    command: Callable[[CheckContext], str]
    parse: Callable[[int, str, str, CheckContext], Finding]
    applies: Callable[[CheckContext], bool] = lambda ctx: True
    timed: bool = False
