"""`raycluster metrics`: Prometheus targets (file_sd) and Ray's Grafana dashboards for an existing
Prometheus/Grafana.

Every node exports Ray's metrics on `ray.metrics_export_port` at its node IP (fixed, so the targets stay
valid across restarts). The head's Ray writes its own file_sd list (`prom_metrics_service_discovery.json`
in the session dir: every node's metrics address and the dashboard's) and the Grafana dashboards it
generates (`metrics/grafana/dashboards/`); both are read from the head's container. Each target is
scraped once from the head's container to prove it answers.
"""

from __future__ import annotations

import base64
import io
import json
import re
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raycluster_cli.config.inventory import Inventory
from raycluster_cli.errors import OperationError
from raycluster_cli.host.containers import container_name
from raycluster_cli.transport import quote
from raycluster_cli.transport.pool import Connect
from raycluster_cli.verbs import serve_dashboard

SESSION = "/tmp/ray/session_latest"
DISCOVERY = f"{SESSION}/prom_metrics_service_discovery.json"
DASHBOARDS = f"{SESSION}/metrics/grafana/dashboards"
# Caps on the dashboards copied from that folder (one any Ray job can write), as `logs` caps what it fetches.
MIB = 1024 * 1024
DASHBOARD_ARCHIVE_MAX = 4 * MIB  # compressed, cut on the host (its base64 stays under transport/kept.MAX_KEPT)
DASHBOARD_MAX_FILES = 200
DASHBOARD_MAX_FILE = 8 * MIB
DASHBOARD_MAX_TOTAL = 32 * MIB
_DASHBOARD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\.json", re.ASCII)
# Runs in the head's container: GET /metrics of each target (argv), one JSON line of sample counts.
_SCRAPE = """
import json, sys, urllib.request
out = {}
for target in sys.argv[1:]:
    try:
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as r:
            text = r.read().decode(errors="replace")
        out[target] = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
    except Exception as exc:
        out[target] = f"{type(exc).__name__}: {exc}"[:200]
print(json.dumps(out))
"""


@dataclass
class Target:
    address: str  # HOST:PORT
    host: str = ""  # the inventory host it belongs to ('' for the dashboard's own metrics)
    in_ray_list: bool = False  # Ray's own service-discovery file lists it
    samples: int = 0
    error: str = ""

    @property
    def up(self) -> bool:
        return not self.error and self.samples > 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.address,
            "host": self.host,
            "in_ray_list": self.in_ray_list,
            "up": self.up,
            "samples": self.samples,
            "error": self.error,
        }


@dataclass
class MetricsResult:
    out: Path
    targets: list[Target]
    files: list[str] = field(default_factory=list)
    dashboards: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(t.up for t in self.targets)


def expected_targets(inventory: Inventory) -> list[Target]:
    """Every host's metrics address from the inventory (pure)."""
    port = inventory.ray.metrics_export_port
    return [Target(f"{inventory.node_ip(h)}:{port}", str(h.address)) for h in inventory.hosts]


def merge_ray_list(targets: list[Target], ray_file: str) -> list[Target]:
    """Mark the inventory's targets that Ray lists; add Ray's others (the dashboard's metrics) (pure)."""
    try:
        groups = json.loads(ray_file) if ray_file.strip() else []
    except ValueError:
        groups = []
    listed = [t for g in groups if isinstance(g, dict) for t in g.get("targets", []) if isinstance(t, str)]
    by_address = {t.address: t for t in targets}
    merged = list(targets)
    for address in listed:
        if address in by_address:
            by_address[address].in_ray_list = True
        else:
            merged.append(Target(address, in_ray_list=True))
    return merged


def file_sd(inventory: Inventory, targets: list[Target]) -> list[dict[str, Any]]:
    """The Prometheus file_sd document: one group per node (labels say which host and role) (pure)."""
    roles = {str(h.address): h.role for h in inventory.hosts}
    groups = []
    for target in targets:
        labels = {"job": "ray", "ray_cluster": inventory.cluster}
        if target.host:
            labels |= {"raycluster_host": target.host, "raycluster_role": roles[target.host]}
        else:
            labels["raycluster_role"] = "dashboard"
        groups.append({"targets": [target.address], "labels": labels})
    return groups


def scrape_config(inventory: Inventory, sd_file: Path) -> str:
    """A scrape_configs entry to paste into prometheus.yml (pure)."""
    return (
        f"# Add to prometheus.yml (scrape_configs:) to scrape Ray cluster {inventory.cluster}.\n"
        f"scrape_configs:\n  - job_name: ray-{inventory.cluster}\n    file_sd_configs:\n"
        f"      - files: ['{sd_file.resolve()}']\n"
    )


def collect_metrics(inventory: Inventory, connect: Connect, out: Path) -> MetricsResult:
    """Write DIR/prometheus/<cluster>.json (+ scrape config) and DIR/grafana/dashboards/*.json."""
    head = connect(inventory.head_host)
    name = quote(container_name(inventory, inventory.head_host))
    listing = head.run(f"docker exec {name} cat {DISCOVERY}", timeout=60)
    if not listing.ok and "no such container" in (listing.stderr + listing.stdout).lower():
        raise OperationError(f"{inventory.head_host.address}: no head container", "run `raycluster up` first")
    result = MetricsResult(out, merge_ray_list(expected_targets(inventory), listing.stdout if listing.ok else ""))
    if not listing.ok:
        result.warnings.append(f"Ray's target list {DISCOVERY} is not readable: {listing.first_line()}")
    for target in result.targets:
        if target.host and not target.in_ray_list:
            result.warnings.append(f"Ray does not list {target.address} ({target.host}): is its node alive?")
    _scrape(head, name, result.targets)
    sd_dir, dash_dir = out / "prometheus", out / "grafana" / "dashboards"
    sd_dir.mkdir(parents=True, exist_ok=True)
    sd_file = sd_dir / f"{inventory.cluster}.json"
    sd_file.write_text(json.dumps(file_sd(inventory, result.targets), indent=2) + "\n")
    config = sd_dir / f"scrape-{inventory.cluster}.yml"
    config.write_text(scrape_config(inventory, sd_file))
    result.files += [str(sd_file), str(config)]
    ray_dashboards = _dashboards(head, name, dash_dir, result.warnings)
    dash_dir.mkdir(parents=True, exist_ok=True)  # the service's own, whatever Ray's gave
    (dash_dir / serve_dashboard.FILE_NAME).write_text(json.dumps(serve_dashboard.dashboard(), indent=2) + "\n")
    result.dashboards = sorted({*ray_dashboards, serve_dashboard.FILE_NAME})
    return result


def _scrape(head: Any, name: str, targets: list[Target]) -> None:
    command = f"docker exec {name} python -c {quote(_SCRAPE)} " + " ".join(quote(t.address) for t in targets)
    done = head.run(command, timeout=120)
    try:
        counts = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        counts = {}
    if not isinstance(counts, dict):
        counts = {}
    for target in targets:
        value = counts.get(target.address, f"not scraped: {done.first_line()}")
        if isinstance(value, int):
            target.samples = value
            if value == 0:
                target.error = "answered with no samples"
        else:
            target.error = str(value)


def _dashboards(head: Any, name: str, folder: Path, warnings: list[str]) -> list[str]:
    """Copy the Grafana dashboards Ray generated on the head into `folder`; their file names. Any Ray job can
    write that folder: the archive is cut on the host (DASHBOARD_ARCHIVE_MAX), and only top-level *.json regular
    files within the caps are written; what is skipped, cut or garbled is one warning naming the host."""
    cut = f"head -c {DASHBOARD_ARCHIVE_MAX}"
    done = head.run(f"docker exec {name} tar -C {DASHBOARDS} -czf - . | {cut} | base64 -w0", timeout=120)
    if not done.ok or not done.stdout.strip():
        warnings.append(f"{head.host}: no Grafana dashboards from Ray at {DASHBOARDS}: {done.first_line()}")
        return []
    try:
        data = base64.b64decode(done.stdout.strip(), validate=True)
    except ValueError as exc:
        warnings.append(f"{head.host}: Grafana dashboards: the head's answer is not an archive ({exc})")
        return []
    folder.mkdir(parents=True, exist_ok=True)
    written, problems = _extract(data, folder)
    if len(data) >= DASHBOARD_ARCHIVE_MAX:
        problems.insert(0, f"the archive was cut at {DASHBOARD_ARCHIVE_MAX // MIB} MiB")
    if problems:
        warnings.append(f"{head.host}: Grafana dashboards: {'; '.join(problems)} ({len(written)} written)")
    return sorted(written)


def _extract(data: bytes, folder: Path) -> tuple[list[str], list[str]]:
    """Write the archive's dashboards into `folder` under the caps: (names written, problems)."""
    written: list[str] = []
    skipped = total = seen = 0
    problems: list[str] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
            for member in archive:
                seen += 1
                name = member.name.removeprefix("./")
                if member.isdir() and name in ("", "."):
                    continue
                fits = len(written) < DASHBOARD_MAX_FILES and member.size <= DASHBOARD_MAX_FILE
                if not (member.isreg() and _DASHBOARD_NAME.fullmatch(name) and fits) or (
                    total + member.size > DASHBOARD_MAX_TOTAL
                ):
                    skipped += 1
                    if seen > 10 * DASHBOARD_MAX_FILES:
                        break
                    continue
                handle = archive.extractfile(member)
                body = handle.read(DASHBOARD_MAX_FILE + 1) if handle is not None else b""
                (folder / name).write_bytes(body)
                written.append(name)
                total += len(body)
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        problems.append(f"the archive is damaged or cut ({exc or type(exc).__name__}): what came before is kept")
    if skipped:
        problems.append(
            f"{skipped} entr{'y' if skipped == 1 else 'ies'} skipped (not a top-level .json file, over "
            f"{DASHBOARD_MAX_FILE // MIB} MiB, or past {DASHBOARD_MAX_FILES} files / {DASHBOARD_MAX_TOTAL // MIB} MiB)"
        )
    return written, problems
