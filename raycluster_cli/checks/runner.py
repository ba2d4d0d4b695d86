"""Apply the checks to every host in parallel; never prints."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from raycluster_cli.checks.base import Check, CheckContext, CheckResult, Finding, Status
from raycluster_cli.checks.catalog import ALL_CHECKS, ALL_IDS
from raycluster_cli.checks.cross import CROSS_CHECKS, Outputs
from raycluster_cli.checks.network import NETWORK_IDS
from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.errors import RayclusterError, UsageError
from raycluster_cli.host.facts import Fact, FactCache, HostFacts, Wanted
from raycluster_cli.transport import CommandResult
from raycluster_cli.transport.fanout import error_message
from raycluster_cli.transport.pool import Connect


def run_checks(
    inventory: Inventory,
    connect: Connect,
    checks: Iterable[Check] = ALL_CHECKS,
    ignore: frozenset[str] = frozenset(),
    hosts: Iterable[str] | None = None,
    cache: FactCache | None = None,
    also: Wanted | None = None,
    refresh: Iterable[Fact[Any]] = (),
) -> list[CheckResult]:
    """Every check on every host, then the cross-host ones; an unreachable host yields one `ssh` failure.

    The checks judge facts gathered in one remote command per host (into `cache`, with the facts `also`
    names for the caller's later steps; `refresh` gathers those facts again). `hosts` (addresses) limits
    the run to those hosts and leaves the cross-host checks out.
    """
    checks = tuple(checks)
    chosen = None if hosts is None else set(hosts)
    targets = [h for h in inventory.hosts if chosen is None or str(h.address) in chosen]
    cache = cache if cache is not None else FactCache(inventory, connect)

    def wanted(ctx: CheckContext) -> list[Fact[Any]]:
        return [c.fact for c in checks if c.applies(ctx)] + list(also(ctx) if also else [])

    cache.gather(targets, wanted, refresh)
    results: list[CheckResult] = []
    outputs: Outputs = {}
    for host in targets:
        error = cache.error(host)
        if error is not None:
            results.append(_error_result("ssh", str(host.address), error))
            results += [CheckResult(c.id, str(host.address), Status.SKIP, _UNREACHABLE) for c in checks]
            continue
        host_results, outputs[str(host.address)] = _judge_host(inventory, host, cache.of(host), checks)
        results += host_results
    for cross in CROSS_CHECKS if chosen is None else ():
        results.extend(cross(inventory, results, outputs))
    return [_demote(r, ignore) for r in results]


_UNREACHABLE = "not checked: host unreachable"


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


def _judge_host(
    inventory: Inventory, host: HostConfig, facts: HostFacts, checks: tuple[Check, ...]
) -> tuple[list[CheckResult], dict[str, CommandResult]]:
    """Each applicable check's finding from the host's gathered facts (pure); the raw output per check id."""
    address = str(host.address)
    results = [CheckResult("ssh", address, Status.OK, "SSH login works")]
    outputs: dict[str, CommandResult] = {}
    ctx = CheckContext(inventory, host)
    for check in checks:
        if not check.applies(ctx):
            continue
        try:
            out = facts.result(check.fact)
            outputs[check.id] = out
            finding = check.parse(out.rc, out.stdout, out.stderr, ctx)
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
