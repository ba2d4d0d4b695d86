"""Apply the checks to every host in parallel; never prints."""

from __future__ import annotations

import time
from collections.abc import Iterable

from ..errors import RayclusterError, TransportError, UsageError
from ..inventory import HostConfig, Inventory
from ..transport import CommandResult
from ..transport.fanout import error_message, fanout
from ..transport.pool import Connect
from .base import Check, CheckContext, CheckResult, Finding, Status
from .catalog import ALL_CHECKS, ALL_IDS
from .cross import CROSS_CHECKS, Outputs
from .network import NETWORK_IDS


def run_checks(
    inventory: Inventory,
    connect: Connect,
    checks: Iterable[Check] = ALL_CHECKS,
    ignore: frozenset[str] = frozenset(),
    hosts: Iterable[str] | None = None,
) -> list[CheckResult]:
    """Every check on every host, then the cross-host ones; an unreachable host yields one `ssh` failure.

    `hosts` (addresses) limits the run to those hosts and leaves the cross-host checks out.
    """
    checks = tuple(checks)
    chosen = None if hosts is None else set(hosts)
    targets = [h for h in inventory.hosts if chosen is None or str(h.address) in chosen]
    outcomes = fanout(targets, lambda host: _check_host(inventory, host, connect, checks), what="run the checks")
    outcomes.check_interrupted()
    results: list[CheckResult] = []
    outputs: Outputs = {}
    for host, outcome in outcomes:
        if outcome.value is not None:
            results.extend(outcome.value[0])
            outputs[str(host.address)] = outcome.value[1]
        else:
            results.append(_error_result("ssh", str(host.address), outcome.error))
    for cross in CROSS_CHECKS if chosen is None else ():
        results.extend(cross(inventory, results, outputs))
    return [_demote(r, ignore) for r in results]


def ignore_ids(text: str | None) -> frozenset[str]:
    """Parse `--ignore ID[,ID...]|all`, refusing unknown ids."""
    if not text:
        return frozenset()
    ids = frozenset(part.strip() for part in text.split(",") if part.strip())
    known = ALL_IDS | NETWORK_IDS
    unknown = ids - known - {"all"}
    if unknown:
        raise UsageError(
            f"--ignore names unknown check(s): {', '.join(sorted(unknown))}",
            f"use any of: {', '.join(sorted(known))}, or all",
        )
    return ids


def _check_host(
    inventory: Inventory, host: HostConfig, connect: Connect, checks: tuple[Check, ...]
) -> tuple[list[CheckResult], dict[str, CommandResult]]:
    address = str(host.address)
    try:
        transport = connect(host)
        transport.run("true", timeout=30)
    except Exception as exc:
        return [_error_result("ssh", address, exc)] + [
            CheckResult(c.id, address, Status.SKIP, "not checked: host unreachable") for c in checks
        ], {}
    results = [CheckResult("ssh", address, Status.OK, "SSH login works")]
    outputs: dict[str, CommandResult] = {}
    ctx = CheckContext(inventory, host)
    lost: TransportError | None = None
    for check in checks:
        if not check.applies(ctx):
            continue
        if lost is not None:  # the host stopped answering: the other checks would each wait out a deadline
            results.append(CheckResult(check.id, address, Status.SKIP, "not checked: the host stopped answering"))
            continue
        try:
            sent = time.time()
            out = transport.run(check.command(ctx), timeout=120)
            if check.timed:
                out = CommandResult(out.rc, f"operator {sent:.6f} {time.time():.6f}\n{out.stdout}", out.stderr)
            outputs[check.id] = out
            finding = check.parse(out.rc, out.stdout, out.stderr, ctx)
        except TransportError as exc:
            lost = exc
            finding = Finding(Status.FAIL, error_message(exc, address), exc.hint)
        except Exception as exc:
            finding = Finding(Status.FAIL, f"check failed to run: {exc}", "run with --debug for details")
        results.append(CheckResult(check.id, address, finding.status, finding.message, finding.hint, finding.data))
    return results, outputs


def _error_result(check_id: str, address: str, error: BaseException | None) -> CheckResult:
    error = error or RuntimeError("no result")
    hint = error.hint if isinstance(error, RayclusterError) else "run with --debug"
    return CheckResult(check_id, address, Status.FAIL, error_message(error, address), hint)


def _demote(result: CheckResult, ignore: frozenset[str]) -> CheckResult:
    if result.status == Status.FAIL and ("all" in ignore or result.id in ignore):
        return CheckResult(result.id, result.host, Status.WARN, result.message + " (ignored)", result.hint, result.data)
    return result


def demote(results: list[CheckResult], ignore: frozenset[str]) -> list[CheckResult]:
    """Apply `--ignore` to results produced elsewhere (e.g. by the network measurement)."""
    return [_demote(r, ignore) for r in results]
