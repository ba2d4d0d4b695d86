"""Preflight checks: each a command run on a host plus a pure parser of its output.

The names below are imported on first use (PEP 562): `status` and `down` use one parser module
(`checks.parsers`, through nodes.py) and do not load the checks themselves.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import Check, CheckContext, CheckResult, Finding, Status
    from .catalog import ALL_CHECKS
    from .runner import demote, ignore_ids, run_checks

_WHERE = {
    "Check": ".base",
    "CheckContext": ".base",
    "CheckResult": ".base",
    "Finding": ".base",
    "Status": ".base",
    "ALL_CHECKS": ".catalog",
    "demote": ".runner",
    "ignore_ids": ".runner",
    "run_checks": ".runner",
}

__all__ = [
    "ALL_CHECKS",
    "Check",
    "CheckContext",
    "CheckResult",
    "Finding",
    "Status",
    "demote",
    "ignore_ids",
    "run_checks",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value
