"""Issue 52, items 1-2: the node containers' restart policy, the head's start script that deploys the service again
when its container starts again, and the service's record it deploys from (write, read, removal, the redeploy's
own deadlines), with real files, a real /bin/sh and the real node probe against an address nothing answers at."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.host.containers import (
    ENV_IN_CONTAINER,
    RESTART_POLICY,
    REVIVE_RECORD,
    config_hash,
    run_argv,
    start_script,
)
from raycluster_cli.serve import revive
from raycluster_cli.serve.options import LaunchOptions
from raycluster_cli.verbs import serve


def test_the_heads_container_starts_the_services_redeploy_beside_ray_only_when_it_holds_the_record(
    example_yaml: str, tmp_path: Path
) -> None:
    """The head's container command under a real /bin/sh (python3 a fake that records its arguments): a container
    that holds the service's record (one that started again after `serve`) runs serve/revive.py with the record
    and the GCS address in the background, then `ray start` in its main process; a fresh one runs only `ray start`."""
    inv = inventory.parse(example_yaml)
    record = tmp_path / "record.json"
    script = start_script(inv, inv.head_host).replace(ENV_IN_CONTAINER, str(tmp_path / "env"))
    script = script.replace(REVIVE_RECORD, str(record))
    (tmp_path / "env").write_text("A=from-env-file\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/bin/sh\necho "A=$A $*" >>"$D/revive"\n')
    (bin_dir / "python3").chmod(0o755)

    def run() -> str:
        done = subprocess.run(
            ["/bin/sh", "-c", script, "sh", "sh", "-c", 'echo "ray $A" >>"$D/ray"', "ray"],
            capture_output=True,
            text=True,
            env={"PATH": f"{bin_dir}:/usr/bin:/bin", "D": str(tmp_path)},
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return (tmp_path / "ray").read_text()

    assert run() == "ray from-env-file\n" and not (tmp_path / "revive").exists()
    record.write_text("{}")
    time_limit = time.monotonic() + 30
    assert run() == "ray from-env-file\n" * 2
    while not (tmp_path / "revive").exists() and time.monotonic() < time_limit:  # it runs in the background
        time.sleep(0.05)
    revive = (tmp_path / "revive").read_text().split()
    assert revive == ["A=from-env-file", "-m", "raycluster_cli.serve.revive", str(record), "--gcs=192.0.2.11:6379"]


def test_every_node_container_restarts_by_itself_unless_stopped_and_the_inventory_may_say_otherwise(
    example_yaml: str,
) -> None:
    """The policy comes before the inventory's run options (Docker keeps the last `--restart` given), and it is
    part of the digest `up` compares, so a container started without it is replaced once."""
    inv = inventory.parse(example_yaml)
    for host in inv.hosts:
        assert run_argv(inv, host).count(f"--restart={RESTART_POLICY}") == 1
    assert RESTART_POLICY == "unless-stopped"
    worker = run_argv(inv, inv.hosts[2])
    assert worker.index("--restart=unless-stopped") < worker.index("--cpus=0.5") < worker.index("raycluster/node:0.1.0")
    without = [word for word in worker if not word.startswith("--restart=")]
    assert config_hash(without) != config_hash(worker)


REPORT = {  # the launcher's document (serve/__main__.py's _report): two replicas of two stages
    "url": "http://192.0.2.11:8000/v1",
    "pipelines": [
        {"stages": [{"units": [0, 2], "node_ip": "192.0.2.12"}, {"units": [2, 4], "node_ip": "192.0.2.11"}]},
        {"stages": [{"units": [0, 2], "node_ip": "192.0.2.13"}, {"units": [2, 4], "node_ip": "192.0.2.12"}]},
    ],
}


def test_the_record_keeps_the_options_as_given_and_the_services_nodes_for_its_owner_only(tmp_path: Path) -> None:
    options = LaunchOptions(model_path="/run/raycluster/models/abc", stages=2, keys_file="/tmp/keys.json", split="1,1")
    path = str(tmp_path / "revive.json")
    revive.write(path, options.model_dump(mode="json"), REPORT)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["revive.json"]  # written whole: no temporary file left
    found = revive.read(path)
    assert found is not None
    kept, nodes = found
    assert nodes == ["192.0.2.11", "192.0.2.12", "192.0.2.13"]
    assert LaunchOptions.model_validate(kept) == options  # the launcher reads back what it deployed with
    revive.write(path, options.model_dump(mode="json"), {"pipelines": [{"stages": ["odd", {"node_ip": ""}]}]})
    assert revive.read(path) == (kept, [])  # a report without node IPs: the redeploy waits for none


def test_a_missing_or_damaged_record_is_nothing_to_deploy(tmp_path: Path, capsys: object) -> None:
    path = tmp_path / "revive.json"
    assert revive.read(str(path)) is None
    for text in ("{", "[]", '{"nodes": []}', '{"options": "x"}', '{"options": {}, "nodes": "x"}'):
        path.write_text(text)
        assert revive.read(str(path)) is None, text
    started = time.monotonic()
    assert revive.revive(str(path), "127.0.0.1:9") == 0 and time.monotonic() - started < 5


def test_serve_stop_removing_the_record_while_the_head_waits_for_its_nodes_ends_the_redeploy(tmp_path: Path) -> None:
    """The real probe against a GCS address that refuses (nothing listens): the nodes never come, the record is
    removed meanwhile, the redeploy ends without running the launcher, within its nodes' wait."""
    path = str(tmp_path / "revive.json")
    revive.write(path, LaunchOptions(model_path="/nowhere").model_dump(mode="json"), REPORT)
    threading.Timer(0.5, os.remove, [path]).start()
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "raycluster_cli.serve.revive", path, "--gcs=127.0.0.1:9", "--nodes-wait=3"],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"PYTHONPATH": str(Path(revive.__file__).parents[2])},
    )
    assert done.returncode == 0, done.stderr
    said = done.stdout.splitlines()
    nodes = "192.0.2.11, 192.0.2.12, 192.0.2.13"
    assert said[0] == f"raycluster: revive: the head started again; waiting for the service's nodes {nodes}"
    assert said[1:] == [
        "raycluster: revive: not every node is back within 3s: deploying on the nodes that are",
        "raycluster: revive: the record was removed (serve --stop): nothing to deploy",
    ]
    assert time.monotonic() - started < 60


def test_a_failing_launcher_is_named_and_not_tried_again_past_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real launcher, given a checkpoint folder that is not there, fails; the redeploy names its error and
    gives up, as another try (RETRY_S later) would pass its deadline."""
    path = str(tmp_path / "revive.json")
    revive.write(path, LaunchOptions(model_path=str(tmp_path / "absent"), no_auth=True).model_dump(mode="json"), {})
    lines: list[str] = []
    monkeypatch.setattr(revive, "say", lines.append)
    monkeypatch.setattr(revive, "RETRY_S", 300.0)
    assert revive.revive(path, "127.0.0.1:9", deadline_s=240.0, nodes_wait_s=0.0) == 1
    assert lines[0] == "the head started again; waiting for the service's nodes (any)"
    assert lines[-1].startswith("gave up after ") and "absent" in lines[-1], lines


def test_serve_asks_the_launcher_for_the_record_and_stop_removes_it_before_the_service() -> None:
    inv = inventory.parse("cluster: demo\nimage: i\nhosts:\n  - {address: 192.0.2.10, role: head}\n", "inv.yaml")
    from raycluster_cli.serve.options import ServeOptions

    launch = serve.launch_options(inv, "/run/raycluster/models/abc", ServeOptions(model_path="x"))
    assert launch.revive == REVIVE_RECORD and REVIVE_RECORD.startswith("/tmp/")

    class Head:
        host = "192.0.2.10"
        command = ""

        def run(self, command: str, **_: object) -> object:
            Head.command = command
            from raycluster_cli.transport.base import CommandResult

            return CommandResult(0, json.dumps({"removed": True}) + "\n", "")

    assert serve.stop(inv, lambda host: Head()) is True  # type: ignore[arg-type,return-value]
    inner = shlex.split(Head.command)[-1]
    assert inner.startswith(f"rm -f {serve.RECORD} {REVIVE_RECORD} && ")
    assert inner.index("rm -f") < inner.index("serve.delete")
