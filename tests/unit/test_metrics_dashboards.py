"""metrics' Grafana dashboards are fetched under caps, as `logs` is (issue 34, item 3): the folder is one any
Ray job can write, so the archive is cut on the host, files are counted and sized before they are written,
only top-level *.json regular files are kept, and a bad archive is a warning naming the host."""

from __future__ import annotations

import base64
import io
import json
import re
import tarfile
from pathlib import Path

from raycluster_cli.config import inventory
from raycluster_cli.serve.metrics import METRICS
from raycluster_cli.transport.fake import FakeTransport
from raycluster_cli.verbs import metrics, serve_dashboard
from raycluster_cli.verbs.metrics import collect_metrics

from .conftest import EXAMPLE

INV = inventory.parse(EXAMPLE)
# The files Ray 2.x generates under metrics/grafana/dashboards (names as a lab head wrote them).
RAY_FILES = ["data_grafana_dashboard.json", "default_grafana_dashboard.json", "serve_grafana_dashboard.json",
             "serve_deployment_grafana_dashboard.json", "train_grafana_dashboard.json"]  # fmt: skip


def _archive(members: dict[str, bytes], extra: list[tarfile.TarInfo] | None = None) -> str:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        for info in extra or []:
            archive.addfile(info)
    return base64.b64encode(buffer.getvalue()).decode()


def _collect(tmp_path: Path, dashboards: str) -> metrics.MetricsResult:
    head = FakeTransport(
        "192.0.2.11",
        {r"cat /tmp/ray/session_latest/prom": "[]", r"python -c": "{}\n", r"tar -C": dashboards},
    )
    result = collect_metrics(INV, lambda host: head, tmp_path)
    tar = next(c for c in head.commands if "tar -C" in c)
    assert f"head -c {metrics.DASHBOARD_ARCHIVE_MAX}" in tar  # cut on the host: only that crosses the network
    return result


def test_rays_dashboards_are_written(tmp_path: Path) -> None:
    body = json.dumps({"title": "Default Dashboard", "panels": []}).encode()
    result = _collect(tmp_path, _archive({name: body for name in RAY_FILES}))
    assert result.dashboards == sorted([*RAY_FILES, serve_dashboard.FILE_NAME])  # and the service's own
    assert (tmp_path / "grafana" / "dashboards" / RAY_FILES[0]).read_bytes() == body
    ours = json.loads((tmp_path / "grafana" / "dashboards" / serve_dashboard.FILE_NAME).read_text())
    assert ours == serve_dashboard.dashboard()


def test_the_service_dashboard_queries_only_metrics_the_service_records() -> None:
    """Every PromQL of the serve dashboard names exported metrics of ``serve.metrics`` (Ray's prefix and suffixes),
    with tags they have; every metric the service records is on some panel."""
    board = serve_dashboard.dashboard()
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    named = {n for e in exprs for n in re.findall(r"ray_raycluster_serve_\w+", e)}
    known = {serve_dashboard.exported(n, part) for n in METRICS for part in ("", "_bucket")}
    assert named <= known, named - known
    covered = {re.sub(r"(_total|_bucket)$", "", n).removeprefix("ray_") for n in named}
    assert covered >= set(METRICS) - {
        "raycluster_serve_prompt_tokens",
        "raycluster_serve_stage_steps",
        "raycluster_serve_outstanding_tokens",
    }
    for expr in exprs:
        for label in re.findall(r"by \(([^)]*)\)", expr):
            tags = {t.strip() for t in label.split(",")} - {"le"}
            assert any(tags <= set(m.tags) for m in METRICS.values()), (expr, tags)
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])


def test_many_files_a_huge_file_links_and_folders_are_skipped_and_counted(tmp_path: Path) -> None:
    members = {f"job_{i:05}.json": b"{}" for i in range(metrics.DASHBOARD_MAX_FILES + 50)}
    members["bomb.json"] = b"\0" * (metrics.DASHBOARD_MAX_FILE + 1)  # compresses to almost nothing
    members["notes.txt"] = b"not a dashboard"
    members["sub/deep.json"] = b"{}"
    link = tarfile.TarInfo("./evil.json")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/shadow"
    result = _collect(tmp_path, _archive(members, [link]))
    assert len(result.dashboards) == metrics.DASHBOARD_MAX_FILES + 1  # Ray's, capped, and the service's own
    assert "bomb.json" not in result.dashboards and "evil.json" not in result.dashboards
    assert not (tmp_path / "grafana" / "dashboards" / "evil.json").exists()
    warning = next(w for w in result.warnings if "dashboards" in w)
    assert warning.startswith("192.0.2.11: ") and "skipped" in warning


def test_a_cut_or_garbled_archive_is_a_warning_naming_the_host(tmp_path: Path) -> None:
    whole = _archive({name: b"{}" * 1000 for name in RAY_FILES})
    for answer in (whole[: len(whole) // 2], "not base64 at all!", base64.b64encode(b"plain text").decode()):
        result = _collect(tmp_path / str(len(answer)), answer)
        warning = next(w for w in result.warnings if "dashboards" in w)
        assert warning.startswith("192.0.2.11: "), warning
