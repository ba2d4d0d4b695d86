"""What `drain`, `undrain` and `status` print of a drain (the --json documents are the verbs' own)."""

from __future__ import annotations

import io

from raycluster_cli.render.base import Output
from raycluster_cli.render.lifecycle import render_drain, render_status
from raycluster_cli.verbs.status import HostStatus, mark_drained


def _printed(render: object, body: dict[str, object]) -> str:
    buffer = io.StringIO()
    render(Output(False, stdout=buffer, stderr=io.StringIO()), body)  # type: ignore[operator]
    return buffer.getvalue()


def test_a_drain_names_the_host_its_pipelines_and_the_streams_finished_and_moved() -> None:
    body = {"host": "192.0.2.13", "action": "drained", "drained": [0], "replaced_by": [3], "finished": 5, "moved": 1}
    text = _printed(render_drain, body | {"seconds": 8.5})
    assert "192.0.2.13 drained in 8.5 s: pipeline(s) 0 replaced by 3" in text
    assert "5 stream(s) finished there, 1 moved at the deadline" in text


def test_undrain_names_what_grew_and_a_host_that_was_not_drained() -> None:
    text = _printed(
        render_drain, {"host": "192.0.2.13", "action": "undrained", "grown": [], "note": "it was not drained"}
    )
    assert "let back" in text and "none (no node was free for one)" in text and "it was not drained" in text


def test_status_lists_the_drained_nodes_beside_the_pipelines() -> None:
    live = {
        "pipelines": [{"index": 1, "state": "live", "served": 4, "stages": [{"node_ip": "192.0.2.11", "blocks": 2}]}],
        "drained": [{"node": "192.0.2.13", "since": 0.0}],
    }
    hosts = [
        HostStatus("192.0.2.11", "head", "192.0.2.11", "running"),
        HostStatus("192.0.2.13", "worker", "192.0.2.13", "running"),
    ]
    mark_drained(hosts, {"live": live})
    assert [h.drained for h in hosts] == [False, True] and hosts[1].to_dict()["drained"] is True
    body = {
        "cluster": "demo",
        "state": "healthy",
        "hosts": [h.to_dict() for h in hosts],
        "totals": {"hosts": 0, "alive_nodes": 0, "resources": {}},
        "service": {"record": {"model": "m", "url": "http://x/v1"}, "serve": {"status": "RUNNING"}, "live": live},
        "service_error": "",
    }
    text = " ".join(_printed(render_status, body).split())
    assert "drained (no stage goes there until raycluster undrain): 192.0.2.13" in text
