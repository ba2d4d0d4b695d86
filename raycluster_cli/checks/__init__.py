"""doctor's preflight checks: each judges facts gathered on a host (host/facts.py) → CheckResult(status, message,
hint); `network` measures head ↔ worker links.

May import host/, transport/, config/ and the root modules. The names below are imported on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raycluster_cli.checks.base import Check, CheckContext, CheckResult, Finding, Status
    from raycluster_cli.checks.catalog import ALL_CHECKS
    from raycluster_cli.checks.runner import demote, ignore_ids, run_checks

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
