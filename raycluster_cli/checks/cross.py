"""Cross-host checks: conclusions that need every host's output at once (pure functions)."""

from __future__ import annotations

from collections import Counter

from raycluster_cli.checks.base import CheckResult, Status
from raycluster_cli.config.inventory import Inventory
from raycluster_cli.host.parsers import is_loopback, parse_etc_hosts, resolve_in_hosts
from raycluster_cli.transport import CommandResult

IMAGE_ID_CHECK = "image"
HOSTS_CHECK = "etc-hosts"
DISK_CHECK = "disk"
CROSS_IDS = ("image-same", "image-fits", "names")

# host address → check id → that check's raw output on the host
Outputs = dict[str, dict[str, CommandResult]]


def image_same(inventory: Inventory, results: list[CheckResult], outputs: Outputs) -> list[CheckResult]:
    """Every host that has the image has the same image ID."""
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


def names_matrix(inventory: Inventory, results: list[CheckResult], outputs: Outputs) -> list[CheckResult]:
    """Name × host: every host's container hostname resolves, in every other host's /etc/hosts, to its node IP.

    A name that another host's /etc/hosts does not list is left to DNS there (not a finding); a name it maps
    to another address fails on the host that has the wrong line.
    """
    names = {r.host: r.data["name"] for r in results if r.id == HOSTS_CHECK and r.data.get("name")}
    expected = {str(h.address): inventory.node_ip(h) for h in inventory.hosts}
    found = []
    for observer, by_check in outputs.items():
        raw = by_check.get(HOSTS_CHECK)
        if raw is None or raw.rc != 0:
            continue
        entries = parse_etc_hosts(raw.stdout.partition("\n---\n")[2])
        row: dict[str, str | None] = {}
        wrong = []
        for host, name in names.items():
            if host == observer:
                continue  # its own name is the etc-hosts check's business
            resolved = resolve_in_hosts(entries, name)
            row[name] = resolved
            if resolved is not None and resolved != expected[host]:
                kind = "loopback " if is_loopback(resolved) else ""
                wrong.append((name, host, resolved, kind))
        if wrong:
            shown = "; ".join(
                f"{name} (host {host}) → {kind}{got}, should be {expected[host]}" for name, host, got, kind in wrong
            )
            fix = ", ".join(f"'{expected[host]} {name}'" for name, host, _, _ in wrong)
            found.append(
                CheckResult(
                    "names",
                    observer,
                    Status.FAIL,
                    f"/etc/hosts here resolves other nodes wrongly: {shown}",
                    f"on {observer}, make /etc/hosts map {fix} (or drop those lines and let DNS answer)",
                    {"resolves": row},
                )
            )
        else:
            listed = sum(v is not None for v in row.values())
            message = f"{listed} of {len(row)} other node name(s) listed in /etc/hosts, all with the right IP"
            found.append(CheckResult("names", observer, Status.OK, message, data={"resolves": row}))
    return found


def image_fits(inventory: Inventory, results: list[CheckResult], outputs: Outputs) -> list[CheckResult]:
    """A host that lacks the image must have room for it: its size on the hosts that have it."""
    disks = {r.host: r.data for r in results if r.id == DISK_CHECK and "docker_root_free_bytes" in r.data}
    sizes = [d["image_bytes"] for d in disks.values() if d.get("image_bytes")]
    if not sizes:
        return []
    need = max(sizes)
    found = []
    for host, data in disks.items():
        if data.get("image_bytes") is None and data["docker_root_free_bytes"] < need:
            free = data["docker_root_free_bytes"]
            found.append(
                CheckResult(
                    "image-fits",
                    host,
                    Status.FAIL,
                    f"{inventory.image} ({need / 1024**3:.1f} GiB on the other hosts) is missing here and only "
                    f"{free / 1024**3:.1f} GiB are free for Docker",
                    f"free space on {host} (docker system prune) before the image is loaded",
                    {"image_bytes": need, "docker_root_free_bytes": free},
                )
            )
    return found


CROSS_CHECKS = (image_same, image_fits, names_matrix)


def image_ids_found(results: list[CheckResult]) -> dict[str, str | None]:
    """Each host's image ID as the `image` check found it (None: the host lacks the image)."""
    ids: dict[str, str | None] = {}
    for result in results:
        if result.id == IMAGE_ID_CHECK and result.status != Status.SKIP:  # SKIP: not checked (unreachable)
            ids[result.host] = result.data.get("image_id") if result.status == Status.OK else None
    return ids


def demote_fixed_image_checks(results: list[CheckResult], fixing: set[str], verb: str) -> list[CheckResult]:
    """Image checks that `up` is about to fix become warnings saying so (`up {verb} it`) (pure).

    `image` failures on the hosts in `fixing`, and `image-same` everywhere when every differing host is being
    fixed (afterwards all hosts have the same image).
    """
    if not fixing:
        return results
    fixed_all = all(r.host in fixing or r.status == Status.OK for r in results if r.id == IMAGE_ID_CHECK)
    out = []
    for result in results:
        fixed = result.status == Status.FAIL and (
            (result.id == IMAGE_ID_CHECK and result.host in fixing) or (result.id == "image-same" and fixed_all)
        )
        if fixed:
            result = CheckResult(
                result.id, result.host, Status.WARN, f"{result.message} (up {verb} it)", result.hint, result.data
            )
        out.append(result)
    return out
