import io

from raycluster_cli.progress import TransferProgress
from raycluster_cli.render.base import Output


def test_live_progress_shows_a_bar_per_host_and_the_lines_between() -> None:
    err = io.StringIO()
    with Output(False, stderr=err).live_progress() as progress:
        progress("preflight [checks]")
        for host in ("192.0.2.12", "192.0.2.13"):
            progress(TransferProgress(host, 0, 2_000_000))
        for host in ("192.0.2.12", "192.0.2.13"):
            progress(TransferProgress(host, 2_000_000, 2_000_000, done=True))
        progress("head next")
    text = err.getvalue()
    assert "· preflight [checks]" in text
    assert "image → 192.0.2.12" in text and "image → 192.0.2.13" in text
    assert "2.0/2.0 MB" in text
    assert text.index("image → 192.0.2.13") < text.index("head next")


def _render(fn: object, body: dict[str, object]) -> str:
    out = io.StringIO()
    output = Output(False, stdout=out)
    output.out.width = 200
    fn(output, body)  # type: ignore[operator]
    return out.getvalue()


def test_render_up_status_logs_down() -> None:
    from raycluster_cli.render.base import render_logs
    from raycluster_cli.render.lifecycle import render_down, render_status, render_up

    node = {"host": "192.0.2.12", "role": "worker", "node_ip": "192.0.2.12", "alive": True}
    up = {
        "nodes": [{**node, "action": "restarted", "reason": "env changed", "resources": {"CPU": 2.0, "special": 2.0}}],
        "images": [
            {
                "host": "192.0.2.12",
                "method": "stream",
                "reason": "missing",
                "bytes_sent": 9e8,
                "codec": "gzip",
                "seconds": 40,
            },
            {
                "host": "192.0.2.13",
                "method": "stream",
                "reason": "missing",
                "bytes_sent": 9e8,
                "codec": "zstd",
                "seconds": 20,
                "source": "192.0.2.12",
                "checksum": "sha256",
            },
        ],
        "warnings": ["Ray token authentication is OFF"],
        "seconds": 12.5,
        "next": {
            "ray_address": "a:6379",
            "dashboard_url": "http://a:8265",
            "submit_job": "ray job submit",
            "status": "s",
            "logs": "l",
        },
    }
    text = _render(render_up, up)
    assert "192.0.2.12: restarted: env changed" in text and "special=2" in text
    assert "image streamed to 192.0.2.12 (missing): 900 MB gzip in 40s\n" in text and "warning:" in text
    assert "192.0.2.13 (missing): 900 MB zstd in 20s from 192.0.2.12, its archive's SHA-256 checked on arrival" in text
    assert "dashboard       http://a:8265" in text
    host = {
        **node,
        "container": "exited",
        "ray_node": "alive",
        "healthy": False,
        "resources": {},
        "image_id": "sha256:" + "a" * 64,
        "ray_version": "2.60.0",
        "error": "",
    }
    status = {
        "cluster": "demo",
        "state": "degraded",
        "hosts": [host],
        "totals": {"hosts": 1, "alive_nodes": 0, "resources": {}},
    }
    text = _render(render_status, status)
    assert (
        "cluster demo: degraded" in text and "exited" in text and "aaaaaaaaaaaa" in text and "0/1 nodes alive" in text
    )
    logs = {
        "out": "/tmp/l",
        "hosts": [
            {
                "host": "192.0.2.12",
                "files": 3,
                "bytes": 2e6,
                "error_lines": 2,
                "first_errors": ["x: ERROR boom"],
                "error": "",
            }
        ],
    }
    assert "x: ERROR boom" in _render(render_logs, logs)
    down = {"removed": [], "purged": [{"host": "192.0.2.12", "item": "image raycluster/node:0.1.0"}], "errors": []}
    assert "purged image raycluster/node:0.1.0 on 192.0.2.12" in _render(render_down, down)


def test_a_hosts_error_that_names_its_host_is_shown_after_the_name_once() -> None:
    from raycluster_cli.render.lifecycle import render_status
    from raycluster_cli.render.operate import render_exec

    def status_of(error: str) -> dict[str, object]:
        host = {
            "host": "192.0.2.11",
            "role": "head",
            "node_ip": "192.0.2.11",
            "container": "unreachable",
            "ray_node": "unknown",
            "healthy": False,
            "resources": {},
            "image_id": "",
            "ray_version": "",
            "error": error,
        }
        return {
            "cluster": "demo",
            "state": "down",
            "hosts": [host],
            "totals": {"hosts": 1, "alive_nodes": 0, "resources": {}},
        }

    # Errors raised for a host begin with its name (the JSON keeps them whole); the line names it once.
    text = _render(render_status, status_of("192.0.2.11: connection refused on port 22"))
    assert "192.0.2.11: connection refused on port 22\n" in text and "192.0.2.11: 192.0.2.11" not in text
    assert "192.0.2.11: docker: not found\n" in _render(render_status, status_of("docker: not found"))

    err = io.StringIO()
    render_exec(
        Output(False, stderr=err), {"hosts": [{"host": "192.0.2.11", "rc": 255, "error": "192.0.2.11: timed out"}]}
    )
    assert err.getvalue() == "192.0.2.11: timed out\n"
