"""Remote JSON of the wrong shape is an error naming the host, or is skipped, never "unexpected AttributeError"
(issue 34, item 11). Each answer is a real one (docker ps, the probe, the jobs API, the scrape, bench's events)
with one part turned into another JSON type, as a broken or hostile host could send."""

from __future__ import annotations

import json
from typing import Any

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.errors import OperationError
from raycluster_cli.host import node
from raycluster_cli.host.containers import list_cluster_containers
from raycluster_cli.transport import CommandResult
from raycluster_cli.transport.fake import FakeTransport
from raycluster_cli.verbs import jobs, metrics
from raycluster_cli.verbs.bench import _Run
from raycluster_cli.verbs.status import HostStatus, merge_nodes

from .conftest import EXAMPLE

INV = inventory.parse(EXAMPLE)
PS_ROW = {"ID": "4f1c2a", "Names": "raycluster-demo-head", "State": "running", "Image": "raycluster/node:0.1.0",
          "Labels": "io.raycluster.cluster=demo,io.raycluster.role=head"}  # fmt: skip


@pytest.mark.parametrize("line", ["[1, 2]", '"a string"', "42", "{not json"])
def test_a_docker_ps_row_that_is_no_object_names_the_host(line: str) -> None:
    host = FakeTransport("192.0.2.11", {"docker ps": json.dumps(PS_ROW) + "\n" + line + "\n"})
    with pytest.raises(OperationError) as info:
        list_cluster_containers(host, INV)
    assert info.value.message.startswith("192.0.2.11: docker ps")


def test_docker_ps_fields_of_the_wrong_type_are_read_as_empty() -> None:
    odd = PS_ROW | {"Labels": [1, 2], "Names": 7, "State": {"x": 1}}
    host = FakeTransport("192.0.2.11", {"docker ps": json.dumps(odd) + "\n"})
    assert list_cluster_containers(host, INV) == []  # no cluster label: not ours


def test_the_probes_node_list_of_the_wrong_shape_names_the_host() -> None:
    for document in ({"nodes": "x"}, {"nodes": [1, "a"]}, {"error": ["x"]}):
        head = FakeTransport("192.0.2.11", {"": CommandResult(0, json.dumps(document) + "\n", "")})
        try:
            nodes = node.probe(head, INV, [], 0)
        except OperationError as exc:
            assert exc.message.startswith("192.0.2.11: ")
        else:
            assert all(isinstance(n, dict) for n in nodes)


def test_status_skips_node_rows_that_are_no_objects() -> None:
    host = HostStatus("192.0.2.11", "head", "192.0.2.11", "running")
    merge_nodes([host], [1, "x", {"node_ip": "192.0.2.11", "alive": True, "resources": [1, 2]}])  # type: ignore[list-item]
    assert host.ray_node == "alive" and host.resources == {}


class Answers:
    host = "192.0.2.11"

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def request(self, method: str, path: str, body: bytes | None = None, kind: str = "") -> Any:
        return self.answer


@pytest.mark.parametrize("answer", ["<html>bad gateway</html>", [1, 2], 3])
def test_a_jobs_answer_that_is_no_object_names_the_head(answer: Any) -> None:
    job = jobs.JobResult("raysubmit_1", "RUNNING")
    with pytest.raises(OperationError) as info:
        jobs._refresh(Answers(answer), job)  # type: ignore[arg-type]
    assert info.value.message.startswith("192.0.2.11: ") and "/api/jobs/raysubmit_1" in info.value.message


def test_a_scrape_answer_that_is_no_object_marks_the_targets_not_scraped() -> None:
    head = FakeTransport("192.0.2.11", {"python -c": "[1, 2]\n"})
    targets = metrics.expected_targets(INV)
    metrics._scrape(head, "raycluster-demo-head", targets)
    assert all(t.error.startswith("not scraped") for t in targets)


def test_bench_events_and_result_of_the_wrong_shape() -> None:
    head = FakeTransport(
        "192.0.2.11",
        {
            r"tail -c": '[1]\n"x"\n{"kind": "stage", "node_ip": "192.0.2.12"}\n@@raycluster-rc\n',
            r"result.json": "[1, 2]\n",
        },
    )
    run = _Run(head, "raycluster-demo-head")
    events, _ = run.poll()
    assert events == [{"kind": "stage", "node_ip": "192.0.2.12"}]
    with pytest.raises(OperationError) as info:
        run.result()
    assert info.value.message.startswith("192.0.2.11: ")
