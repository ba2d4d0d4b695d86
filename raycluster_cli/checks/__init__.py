"""Preflight checks: each a command run on a host plus a pure parser of its output."""

from .base import Check, CheckContext, CheckResult, Finding, Status
from .catalog import ALL_CHECKS
from .runner import demote, ignore_ids, run_checks

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
