"""metrics: the inventory's fixed targets, Ray's own list merged in, the file_sd document, the scrape."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.errors import InventoryError
from raycluster_cli.host.containers import ray_start_args
from raycluster_cli.transport import CommandResult
from raycluster_cli.transport.fake import FakeTransport
from raycluster_cli.verbs.metrics import collect_metrics, expected_targets, file_sd, merge_ray_list

from .conftest import EXAMPLE

INV = inventory.parse(EXAMPLE)
RAY_LIST = json.dumps(
    [{"labels": {"job": "ray"}, "targets": ["192.0.2.11:8080", "192.0.2.12:8080", "192.0.2.11:44227"]}]
)


def test_every_node_exports_on_the_inventorys_fixed_port() -> None:
    assert "--metrics-export-port=8080" in ray_start_args(INV, INV.hosts[0])
    custom = inventory.parse(EXAMPLE + "ray: {metrics_export_port: 9100}\n")
    assert all("--metrics-export-port=9100" in ray_start_args(custom, h) for h in custom.hosts)
    assert [t.address for t in expected_targets(custom)] == ["192.0.2.11:9100", "192.0.2.12:9100", "192.0.2.13:9100"]


def test_a_metrics_port_inside_the_worker_range_is_refused() -> None:
    with pytest.raises(InventoryError, match="worker port range"):
        inventory.parse(EXAMPLE + "ray: {metrics_export_port: 12000}\n")


def test_rays_list_marks_the_nodes_it_knows_and_adds_the_dashboards_metrics() -> None:
    merged = merge_ray_list(expected_targets(INV), RAY_LIST)
    assert [(t.address, t.host, t.in_ray_list) for t in merged] == [
        ("192.0.2.11:8080", "192.0.2.11", True),
        ("192.0.2.12:8080", "192.0.2.12", True),
        ("192.0.2.13:8080", "192.0.2.13", False),
        ("192.0.2.11:44227", "", True),
    ]
    assert [t.in_ray_list for t in merge_ray_list(expected_targets(INV), "not json")] == [False] * 3


def test_file_sd_has_one_labelled_group_per_target() -> None:
    groups = file_sd(INV, merge_ray_list(expected_targets(INV), RAY_LIST))
    assert groups[0] == {
        "targets": ["192.0.2.11:8080"],
        "labels": {"job": "ray", "ray_cluster": "demo", "raycluster_host": "192.0.2.11", "raycluster_role": "head"},
    }
    assert groups[3]["labels"]["raycluster_role"] == "dashboard"


def test_collect_writes_the_target_file_and_reports_what_did_not_answer(tmp_path: Path) -> None:
    scraped = json.dumps({"192.0.2.11:8080": 120, "192.0.2.12:8080": 80, "192.0.2.13:8080": "URLError: refused",
                          "192.0.2.11:44227": 10})  # fmt: skip
    head = FakeTransport(
        "192.0.2.11",
        {
            r"cat /tmp/ray/session_latest/prom": RAY_LIST,
            r"python -c": scraped + "\n",
            r"tar -C": CommandResult(2, "", "tar: no such directory"),
        },
    )
    result = collect_metrics(INV, lambda host: head, tmp_path)
    assert not result.ok
    assert [(t.address, t.up) for t in result.targets][2] == ("192.0.2.13:8080", False)
    scrape = next(c for c in head.commands if "python -c" in c)
    assert shlex.split(scrape)[-4:] == [t.address for t in result.targets]
    written = json.loads((tmp_path / "prometheus" / "demo.json").read_text())
    assert [g["targets"][0] for g in written] == [t.address for t in result.targets]
    assert "file_sd_configs" in (tmp_path / "prometheus" / "scrape-demo.yml").read_text()
    assert any("does not list 192.0.2.13:8080" in w for w in result.warnings)
    assert any("no Grafana dashboards" in w for w in result.warnings)
