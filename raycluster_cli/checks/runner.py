"""Apply the checks to every host in parallel; never prints."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from ..errors import RayclusterError, UsageError
from ..inventory import HostConfig, Inventory
from ..transport import Transport
from ..transport.fanout import fanout
from .base import Check, CheckContext, CheckResult, Finding, Status
from .catalog import ALL_CHECKS, IMAGE_ID_CHECK

Connect = Callable[[HostConfig], Transport]


def run_checks(
    inventory: Inventory,
    connect: Connect,
    checks: Iterable[Check] = ALL_CHECKS,
    ignore: frozenset[str] = frozenset(),
) -> list[CheckResult]:
    """Every check on every host; an unreachable host yields one `ssh` failure and skips the rest."""
    checks = tuple(checks)
    outcomes = fanout(inventory.hosts, lambda host: _check_host(inventory, host, connect, checks))
    results: list[CheckResult] = []
    for host, outcome in outcomes:
        if outcome.value is not None:
            results.extend(outcome.value)
        else:
            results.append(_error_result("ssh", str(host.address), outcome.error))
    results.extend(_same_image_everywhere(inventory, results))
    return [_demote(r, ignore) for r in results]


def ignore_ids(text: str | None) -> frozenset[str]:
    """Parse `--ignore ID[,ID...]|all`, refusing unknown ids."""
    if not text:
        return frozenset()
    ids = frozenset(part.strip() for part in text.split(",") if part.strip())
    known = {c.id for c in ALL_CHECKS} | {"ssh", "image-same"}
    unknown = ids - known - {"all"}
    if unknown:
        raise UsageError(
            f"--ignore names unknown check(s): {', '.join(sorted(unknown))}",
            f"use any of: {', '.join(sorted(known))}, or all",
        )
    return ids


def _check_host(
    inventory: Inventory, host: HostConfig, connect: Connect, checks: tuple[Check, ...]
) -> list[CheckResult]:
    address = str(host.address)
    try:
        transport = connect(host)
        transport.run("true", timeout=30)
    except Exception as exc:
        return [_error_result("ssh", address, exc)] + [
            CheckResult(c.id, address, Status.SKIP, "not checked: host unreachable") for c in checks
        ]
    results = [CheckResult("ssh", address, Status.OK, "SSH login works")]
    ctx = CheckContext(inventory, host)
    for check in checks:
        if not check.applies(ctx):
            continue
        try:
            out = transport.run(check.command(ctx), timeout=60)
            finding = check.parse(out.rc, out.stdout, out.stderr, ctx)
        except Exception as exc:
            finding = Finding(Status.FAIL, f"check failed to run: {exc}", "run with --debug for details")
        results.append(CheckResult(check.id, address, finding.status, finding.message, finding.hint, finding.data))
    return results


def _error_result(check_id: str, address: str, error: BaseException | None) -> CheckResult:
    if isinstance(error, RayclusterError):
        message = error.message.removeprefix(f"{address}: ")
        return CheckResult(check_id, address, Status.FAIL, message, error.hint)
    return CheckResult(check_id, address, Status.FAIL, f"{type(error).__name__}: {error}", "run with --debug")


def _same_image_everywhere(inventory: Inventory, results: list[CheckResult]) -> list[CheckResult]:
    """Cross-host: every host that has the image has the same image ID."""
    ids = {r.host: r.data["image_id"][7:19] for r in results if r.id == IMAGE_ID_CHECK and "image_id" in r.data}
    if len(set(ids.values())) <= 1:
        return []
    majority = Counter(ids.values()).most_common(1)[0][0]
    return [
        CheckResult(
            "image-same",
            host,
            Status.FAIL,
            f"{inventory.image} here is {image_id}, most hosts have {majority}",
            f"`raycluster up` streams this machine's image to {host} (or: docker save {inventory.image} | ssh {host} docker load)",
        )
        for host, image_id in ids.items()
        if image_id != majority
    ]


def _demote(result: CheckResult, ignore: frozenset[str]) -> CheckResult:
    if result.status == Status.FAIL and ("all" in ignore or result.id in ignore):
        return CheckResult(result.id, result.host, Status.WARN, result.message + " (ignored)", result.hint, result.data)
    return result
