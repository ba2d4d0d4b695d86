"""The operator's side of `serve` without a cluster: the launcher's command line, the default split across every
node, the model's copies only where missing, and the status line."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from raycluster_cli import apikeys
from raycluster_cli.config import inventory
from raycluster_cli.delivery import models, receive
from raycluster_cli.errors import OperationError
from raycluster_cli.host.containers import TOKEN_IN_CONTAINER
from raycluster_cli.render.lifecycle import _live_lines, _service_line
from raycluster_cli.serve.options import ServeOptions
from raycluster_cli.transport.base import CommandResult
from raycluster_cli.verbs import serve

INVENTORY = """
cluster: demo
image: raycluster/node:0.1.0
host_state_dir: /srv/rc
hosts:
  - {address: 192.0.2.10, role: head}
  - {address: 192.0.2.11, role: worker}
  - {address: 192.0.2.12, role: worker}
"""


class Host:
    """A host that answers the held-models question and records what it was fed."""

    def __init__(self, address: str, held: set[str]) -> None:
        self.host, self.held, self.commands, self.fed = address, held, [], 0
        self.written: dict[str, bytes] = {}

    def run(self, command: str, stdin: bytes | None = None, **_: object) -> CommandResult:
        self.commands.append(command)
        if "cat /tmp/raycluster-serve-keys.json" in command:  # no keys document yet
            return CommandResult(1, "", "cat: /tmp/raycluster-serve-keys.json: No such file or directory")
        if command.startswith("docker exec -i") and "umask 077" in command:  # a file written from stdin
            self.written[command.split("cat > ")[1].split(".tmp")[0].strip("'\"")] = stdin or b""
            return CommandResult(0, "", "")
        if "raycluster-manifest" in command and "for m in" in command:
            return CommandResult(0, "".join(f"{d}\t1000\ttiny\n" for d in self.held), "")
        if command.startswith("for t in zstd"):  # the relay's look at the host's tools
            return CommandResult(0, "bash\ntimeout\nsha256sum\npython3\n", "")
        if "; rm -f -- " in command:  # the relay's clean-up of its staged copy
            return CommandResult(0, "", "")
        document = {
            "url": "http://192.0.2.10:8000/v1",
            "model": "tiny",
            "replicas": 1,
            "split": [[0, 2], [2, 4]],
            "pipelines": [{"stages": [{"units": [0, 2], "blocks": 1, "node_ip": "192.0.2.11"}]}],
        }
        return CommandResult(0, "ray says hello\n" + json.dumps(document) + "\n", "")

    def feed(self, command: str, source: object, on_sent: Any = None, **_: object) -> CommandResult:
        data = source.read()  # type: ignore[attr-defined]
        self.fed += len(data)
        if on_sent is not None:
            on_sent(len(data))
        self.commands.append(command)
        return CommandResult(0, f"{receive.PUBLISHED}\n{models.RECEIVED}\n", "")


def _model(tmp_path: Path, layers: int = 2) -> Path:
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": layers}))
    (folder / "model.safetensors").write_bytes(b"\x01" * 1000)
    return folder


def _flags(*argv: str) -> dict[str, Any]:
    """`raycluster serve`'s flags as its real command parses them (Typer/click), ServeOptions' fields only."""
    import typer

    from raycluster_cli.cli.app import app
    from raycluster_cli.serve.options import ServeOptions

    params = typer.main.get_command(app).commands["serve"].make_context("serve", list(argv)).params  # type: ignore[attr-defined]
    return {k: v for k, v in params.items() if k in ServeOptions.model_fields}


def test_the_launcher_runs_in_the_heads_container_with_the_services_keys_not_the_clusters_token() -> None:
    from raycluster_cli.cli.serve import serve_options

    inv = inventory.parse(INVENTORY, "inv.yaml")
    words = shlex.split(serve.launcher_command())
    assert words[:4] == ["set", "-a", "&&", "."]
    assert words[-5:] == ["python", "-m", "raycluster_cli.serve", "--options", f"@{serve.LAUNCH_OPTIONS}"]
    options = serve_options(_flags("--model-path", "x", "--stages", "3", "--dtype", "bfloat16", "--api-key-file", "/k"))
    launch = serve.launch_options(inv, "/run/raycluster/models/abc", options)
    sent = json.loads(launch.model_dump_json())
    assert (
        sent["host"] == "192.0.2.10" and sent["stages"] == 3 and sent["keys_file"] == "/tmp/raycluster-serve-keys.json"
    )
    assert sent["model_path"] == "/run/raycluster/models/abc" and sent["record"] == serve.RECORD
    assert sent["dtype"] == "bfloat16" and sent["no_auth"] is False and sent["tls_cert"] is None
    # this machine's own (its key file, its TLS choice, its deadline) stay here; no token, no key
    assert not {"api_key_file", "tls_self_signed", "timeout"} & set(sent)
    assert TOKEN_IN_CONTAINER not in json.dumps(sent) and "/k" not in json.dumps(sent)
    tls = serve.launch_options(inv, "/m", options, ("/t/cert.pem", "/t/key.pem"))
    assert (tls.tls_cert, tls.tls_key) == ("/t/cert.pem", "/t/key.pem")
    assert sent["image_steps"] == 20 and sent["rebalance_period"] == 20.0 and sent["steps_in_flight"] == 0
    tuned = serve_options(
        _flags("--model-path", "x", "--rebalance-period", "0", "--steps-in-flight", "4", "--image-max-steps", "300")
    )
    assert (tuned.rebalance_period, tuned.steps_in_flight, tuned.image_max_steps) == (0, 4, 300)


def test_a_bad_flag_is_one_line_naming_it_and_the_fix() -> None:
    """Bounds and choices live in ServeOptions: the CLI refuses before touching the inventory, one line each."""
    from typer.testing import CliRunner

    from raycluster_cli.cli.app import app

    for argv, said in [
        (["--port", "0"], "--port 0: Input should be greater than or equal to 1"),
        (["--slots", "-1"], "--slots -1: Input should be greater than or equal to 0"),
        (["--dtype", "fp8"], "--dtype 'fp8' is not one of auto, float32, bfloat16, float16"),
        (["--links", "udp"], "--links 'udp' is not one of direct, ray"),
        (["--image-steps", "501"], "--image-steps 501: Input should be less than or equal to 500"),
    ]:
        done = CliRunner().invoke(app, ["serve", "--model-path", "/m", *argv, "-i", "/nowhere.yaml"])
        flag = argv[0]
        assert done.exit_code == 2, done.output
        assert done.output.splitlines() == [
            f"error: {said} — fix: see `raycluster serve --help` for what {flag} takes"
        ]  # fmt: skip
    missing = CliRunner().invoke(app, ["serve", "-i", "/nowhere.yaml"])
    assert missing.exit_code == 2 and "serve needs --model-path DIR" in missing.output


def test_serve_sends_the_model_only_where_missing_and_splits_it_over_every_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAYCLUSTER_STATE_DIR", str(tmp_path / "state"))
    inv = inventory.parse(INVENTORY, "inv.yaml")
    digest = models.read_model_folder(_model(tmp_path)).digest
    hosts = {str(h.address): Host(str(h.address), {digest} if h.role == "worker" else set()) for h in inv.hosts}
    result = serve.serve(inv, lambda h: hosts[str(h.address)], ServeOptions(model_path=str(tmp_path / "tiny")))  # type: ignore[arg-type,return-value]
    assert {c.host: c.action for c in result.copies} == {
        "192.0.2.10": "sent",
        "192.0.2.11": "held",
        "192.0.2.12": "held",
    }
    model = models.read_model_folder(tmp_path / "tiny")
    assert hosts["192.0.2.10"].fed == model.tar_size and hosts["192.0.2.11"].fed == 0
    assert [c.source for c in result.copies] == ["operator", "", ""] and result.copies[0].bytes_sent == model.tar_size
    received = next(c for c in hosts["192.0.2.10"].commands if "/srv/rc/demo/models" in c and "tar -x" in c)
    assert model.tar_sha256 in received  # the tar is verified whole before it is unpacked
    launch = hosts["192.0.2.10"].commands[-1]
    assert "-m raycluster_cli.serve --options @/tmp/raycluster-serve-options.json" in launch
    sent = json.loads(hosts["192.0.2.10"].written[serve.LAUNCH_OPTIONS])  # the launcher's options, a file there
    assert sent["stages"] == 2  # three nodes, but the model has two blocks
    assert sent["model_id"] == "tiny" and sent["model_path"] == f"/run/raycluster/models/{digest}"
    assert result.model_path == f"/run/raycluster/models/{digest}" and result.url == "http://192.0.2.10:8000/v1"
    assert result.pipelines[0]["stages"][0]["host"] == "192.0.2.11"
    # the service's own default key: kept here 0600, only its digest in the head's container, never the Ray token
    key = Path(str(result.api_key_file)).read_text().strip()
    assert key.startswith("rcs-") and Path(str(result.api_key_file)).stat().st_mode & 0o777 == 0o600
    document = hosts["192.0.2.10"].written["/tmp/raycluster-serve-keys.json"].decode()
    assert key not in document and apikeys.digest(key) in document and key not in launch
    assert key not in json.dumps(sent) and sent["keys_file"] == "/tmp/raycluster-serve-keys.json"
    assert [e.name for e in apikeys.parse_keys(document)] == ["default"] and result.tls_cert_file is None


def test_the_status_line_says_what_is_served_and_ray_serves_state() -> None:
    running = {
        "record": {"model": "tiny", "url": "http://h:8000/v1"},
        "serve": {"status": "RUNNING", "deployments": {"Ingress": {"status": "HEALTHY", "replicas": {"RUNNING": 1}}}},
    }
    assert "tiny at http://h:8000/v1" in _service_line(running, "") and "RUNNING" in _service_line(running, "")
    assert _service_line(None, "").startswith("no service")
    assert "could not be read" in _service_line(None, "h: refused")


def test_the_status_script_reads_ray_serve_and_the_services_own_pipelines_over_http(tmp_path: Path) -> None:
    """The script `status` runs in the head's container, against two loopback HTTP servers standing in for Ray's
    dashboard and the service: Ray Serve's state, then the service's pipelines now (after a re-split: the new
    one live, the old one draining) with the token sent to both; a service that does not answer is an error
    beside the rest, not a failure."""
    import http.server
    import subprocess
    import sys
    import threading

    seen: list[tuple[str, str | None]] = []
    live = {
        "replicas": 1, "failovers": 0,
        "pipelines": [
            {"index": 0, "state": "draining", "served": 40, "stages": [{"node_ip": "10.0.0.1", "blocks": 5}]},
            {"index": 1, "state": "live", "served": 3,
             "stages": [{"node_ip": "10.0.0.1", "blocks": 4, "device": "cpu", "matmuls": {"blocks": {}, "packed_mb": 0.0},
                         "steps": 7}],
             "links": "ray", "links_note": "direct links did not form (TimeoutError: ): steps go through Ray's calls"},
        ],
        "events": [{"event": "rebalanced", "pipeline": 1, "detail": "replaces 0: re-split"}],
    }  # fmt: skip

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append((self.path, self.headers.get("Authorization")))
            body = (
                live if self.path == "/raycluster/status" else {"applications": {"raycluster": {"status": "RUNNING"}}}
            )
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    token = tmp_path / "token"
    token.write_text("secret\n")

    def run(record: dict[str, Any]) -> dict[str, Any]:
        (tmp_path / "record.json").write_text(json.dumps(record))
        url = f"http://127.0.0.1:{port}/api/serve/applications/"
        script = serve._STATUS % {
            "record": str(tmp_path / "record.json"),
            "url": url,
            "token": str(token),
            "app": "raycluster",
        }
        given = json.dumps({"key": "service-key", "cert": None})
        done = subprocess.run(
            [sys.executable, "-c", script], input=given, capture_output=True, text=True, timeout=60, check=True
        )
        document: dict[str, Any] = json.loads(done.stdout)
        return document

    try:
        doc = run({"model": "tiny", "url": f"http://127.0.0.1:{port}/v1"})
        gone = run({"model": "tiny", "url": "http://127.0.0.1:9/v1"})  # nothing listens on the discard port
    finally:
        server.shutdown()
    assert doc["serve"]["status"] == "RUNNING" and doc["live"]["pipelines"][1]["served"] == 3
    # the dashboard's API with the cluster's token, the service with its own key (from the operator, on stdin)
    assert ("/raycluster/status", "Bearer service-key") in seen and ("/raycluster/status", "Bearer secret") not in seen
    assert all(auth == "Bearer secret" for path, auth in seen if path != "/raycluster/status")
    lines = _live_lines(doc["live"])
    assert (
        lines[1] == "  pipeline 1 (live, served 3, ray links): 10.0.0.1 4 block(s) on cpu" and "rebalanced" in lines[-1]
    )
    assert doc["live"]["pipelines"][1]["stages"][0] == {  # its device and products' plan kept, not its counters
        "node_ip": "10.0.0.1", "blocks": 4, "device": "cpu", "matmuls": {"blocks": {}, "packed_mb": 0.0},
    }  # fmt: skip
    assert lines[2].strip().startswith("direct links did not form")  # why a pipeline kept Ray's calls
    assert gone["serve"]["status"] == "RUNNING" and "live" not in gone and gone["live_error"]


def test_an_image_service_shows_each_replicas_parts_and_speed_and_how_to_ask_for_an_image() -> None:
    import io

    from raycluster_cli.render.base import Output
    from raycluster_cli.render.operate import render_serve

    stage = {"node_ip": "192.0.2.11", "host": "192.0.2.11", "parts": ["text", "unet", "vae"]}
    body = serve.ServeResult(
        url="http://192.0.2.10:8000/v1", model="tiny-sd", replicas=1, split=None, model_path="/m", model_digest=None,
        pipelines=[{"stages": [stage], "s_per_image": 1.25, "why": "1 of 3 node(s) hold the whole pipeline"}],
        kind="image",
    ).to_dict()  # fmt: skip
    buffer = io.StringIO()
    render_serve(Output(False, stdout=buffer, stderr=io.StringIO()), body)
    text = buffer.getvalue()
    assert "replica 0: 192.0.2.11: text+unet+vae, 1.25 s/image" in text
    assert "images.generate(" in text and "chat/completions" not in text
    assert "raycluster metrics --out DIR" in text  # where its metrics go
    record = {
        "record": {"model": "tiny-sd", "url": "http://h:8000/v1", "kind": "image"},
        "serve": {"status": "RUNNING"},
    }
    assert "tiny-sd at http://h:8000/v1 (images)" in _service_line(record, "")


def test_a_launcher_error_that_names_its_flag_is_the_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Refusing(Host):
        def run(self, command: str, stdin: bytes | None = None, **kw: object) -> CommandResult:
            if "-m raycluster_cli.serve" in command:
                why = "ValueError: prompt + new tokens (512) exceed the model's 256 positions: pass --max-seq 256"
                return CommandResult(1, "", f"Traceback ...\n{why}\n")
            return super().run(command, stdin, **kw)

    monkeypatch.setenv("RAYCLUSTER_STATE_DIR", str(tmp_path / "state"))
    inv = inventory.parse(INVENTORY, "inv.yaml")
    digest = models.read_model_folder(_model(tmp_path)).digest
    hosts = {str(h.address): Refusing(str(h.address), {digest}) for h in inv.hosts}
    with pytest.raises(OperationError) as failed:
        serve.serve(inv, lambda h: hosts[str(h.address)], ServeOptions(model_path=str(tmp_path / "tiny")))  # type: ignore[arg-type,return-value]
    assert "256 positions" in str(failed.value) and failed.value.hint == "run raycluster serve again with --max-seq 256"
