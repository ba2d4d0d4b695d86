"""The head-side probe reads the GCS's node table without `ray.init` and reports it as `ray.nodes()` did."""

from __future__ import annotations

import pytest

from raycluster_cli.host import probe

gcs_pb2 = pytest.importorskip("ray.core.generated.gcs_pb2")


def _info(ip: str, state: int, **resources: float) -> object:
    return gcs_pb2.GcsNodeInfo(
        node_manager_address=ip, node_manager_hostname=f"host-{ip}", state=state, resources_total=resources
    )


def test_a_gcs_node_record_reads_as_the_drivers_view() -> None:
    alive = probe._from_gcs("ab12", _info("10.0.0.2", gcs_pb2.GcsNodeInfo.ALIVE, CPU=4.0, **{"node:10.0.0.2": 1.0}))
    dead = probe._from_gcs("cd34", _info("10.0.0.3", gcs_pb2.GcsNodeInfo.DEAD, CPU=2.0))

    assert alive == {
        "node_ip": "10.0.0.2",
        "node_id": "ab12",
        "hostname": "host-10.0.0.2",
        "alive": True,
        "resources": {"CPU": 4.0},  # node:<ip> is Ray's own marker, not a resource a user asked for
    }
    assert dead["alive"] is False and dead["resources"] == {"CPU": 2.0}


def test_the_driver_fallback_reports_the_same_fields() -> None:
    record = {
        "NodeManagerAddress": "10.0.0.2",
        "NodeID": "ab12",
        "NodeManagerHostname": "host-10.0.0.2",
        "Alive": True,
        "Resources": {"CPU": 4.0, "node:10.0.0.2": 1.0},
    }
    from_gcs = probe._from_gcs("ab12", _info("10.0.0.2", gcs_pb2.GcsNodeInfo.ALIVE, CPU=4.0, **{"node:10.0.0.2": 1.0}))

    assert probe._from_driver(record) == from_gcs
