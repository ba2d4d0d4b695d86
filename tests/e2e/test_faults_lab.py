"""Real faults on the lab: a host frozen (docker pause) before and after login in every verb, a connection
cut (iptables in the host's namespace) and a Ctrl-C (SIGINT to a real process) in the middle of an image
stream and while waiting for nodes. Each ends within its deadline naming the host; nothing of ours is
left on the hosts; the rerun completes the cluster. Deadlines are short (faults.QUICK_SSH)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raycluster_cli.checks import run_checks
from raycluster_cli.config import inventory as inventory_module
from raycluster_cli.lab import hosts as lab
from raycluster_cli.transport import logins
from raycluster_cli.transport.pool import SSHPool
from raycluster_cli.verbs.down import down
from raycluster_cli.verbs.logs import collect
from raycluster_cli.verbs.status import status

from .conftest import IP1, IP2, IP3, Lab
from .faults import (
    CUT,
    LOGIN_DEADLINE_S,
    SLACK_S,
    UNCUT,
    Verb,
    freeze,
    frozen,
    processes,
    quick_inventory,
    thaw,
    wait_until,
)

pytestmark = pytest.mark.lab
KEEPALIVE_DEADLINE_S = 6  # QUICK_SSH: 2 s × 3 of silence
STALL_DEADLINE_S = 5
OURS_ON_HOST = r"docker load|gzip -dc|zstd -dc|tail -c \+1|sha256sum|raycluster-guard"


@pytest.fixture(scope="module")
def quick(lab_hosts: Lab, tmp_path_factory: pytest.TempPathFactory) -> str:
    return quick_inventory(lab_hosts, tmp_path_factory.mktemp("faults") / "quick.yaml")


@pytest.mark.parametrize("verb", ["doctor", "status", "logs", "down"])
def test_a_host_frozen_before_login_fails_in_time_naming_it(
    lab_hosts: Lab, quick: str, verb: str, tmp_path: Path
) -> None:
    args = ("--out", str(tmp_path / "logs")) if verb == "logs" else ()  # not a folder in the working directory
    with frozen(lab_hosts, "lab-h3"):
        started = time.monotonic()
        code, doc, err = lab_hosts.cli(verb, *args, inventory=quick, timeout=120)
        elapsed = time.monotonic() - started
    assert code == 1, err
    assert elapsed <= LOGIN_DEADLINE_S + SLACK_S, elapsed
    assert "Traceback" not in err
    text = str(doc)
    assert IP3 in text and "banner" in text, text
    if verb == "doctor":
        assert {c["host"] for c in doc["checks"] if c["id"] == "ssh" and c["status"] == "ok"} == {IP1, IP2}


def _pool_logged_in(quick: str) -> tuple[inventory_module.Inventory, SSHPool]:
    inv = inventory_module.load(quick).inventory
    pool = SSHPool(inv)
    for host in inv.hosts:
        pool(host)  # every host logged in before it freezes
    return inv, pool


def _work(the_lab: Lab, inv: inventory_module.Inventory, pool: SSHPool, work: str) -> tuple[object, float]:
    started = time.monotonic()
    if work == "doctor":
        result: object = run_checks(inv, pool)
    elif work == "status":
        result = status(inv, pool)
    elif work == "logs":
        result = collect(inv, pool, Path(the_lab.info.inventory_path).parent / "faults-logs", inv.hosts)
    else:
        result = down(inv, pool)
    return result, time.monotonic() - started


def _after_login(the_lab: Lab, quick: str, work: str) -> tuple[object, float, float]:
    """The verb's result and time with lab-h3 frozen after login, and its time on the same hosts unfrozen
    (this machine's load, not the fault, sets most of a verb's time here)."""
    inv, pool = _pool_logged_in(quick)
    try:
        _, baseline = _work(the_lab, inv, pool, work)
        with frozen(the_lab, "lab-h3"):
            result, elapsed = _work(the_lab, inv, pool, work)
        return result, elapsed, baseline
    finally:
        pool.close()


@pytest.mark.parametrize("verb", ["doctor", "status", "logs", "down"])
def test_a_host_frozen_after_login_fails_in_time_naming_it(lab_hosts: Lab, quick: str, verb: str) -> None:
    result, elapsed, baseline = _after_login(lab_hosts, quick, verb)
    assert elapsed <= baseline + KEEPALIVE_DEADLINE_S + LOGIN_DEADLINE_S + SLACK_S, (elapsed, baseline)
    text = repr(result)
    assert IP3 in text and "stopped answering" in text, text


# A `docker` in front of the real one that answers 4 s late: lab-h3's batch of facts is still running when the
# freeze lands (a lean batch can finish in the moment between "logged in" and `docker pause`, and then there
# is nothing left to freeze; CI saw that once).
SLOW_DOCKER = '#!/bin/sh\nsleep 4\nexec /usr/bin/docker "$@"\n'


def test_doctor_process_with_a_host_frozen_just_after_login(lab_hosts: Lab, quick: str) -> None:
    with lab_hosts.shim("lab-h3", "docker", SLOW_DOCKER):
        try:
            verb = Verb("doctor", inventory=quick)
            verb.wait_for(rf"{IP3}: logged in", timeout=120)
            freeze(lab_hosts, "lab-h3")
            frozen_at = time.monotonic()
            code, doc, ended = verb.finish(timeout=120)
        finally:
            thaw(lab_hosts, "lab-h3")
    assert code == 1 and ended - frozen_at <= KEEPALIVE_DEADLINE_S + LOGIN_DEADLINE_S + SLACK_S
    failed = [c for c in doc["checks"] if c["status"] == "fail"]
    assert [c["host"] for c in failed] == [IP3], failed
    assert "stopped answering" in str(failed), failed  # the freeze, not the slow `docker`, failed it


# The same late `docker`, leaving a mark first: the command's own path has no --debug lines to wait for.
CALLED = "/tmp/raycluster-test-docker-called"
MARKED_SLOW_DOCKER = f'#!/bin/sh\ntouch {CALLED}\nsleep 4\nexec /usr/bin/docker "$@"\n'


@pytest.mark.parametrize("verb", ["doctor", "status", "down"])
def test_a_host_frozen_while_its_login_and_first_command_run_ahead_from_the_last_run_fails_in_time_naming_it(
    lab_hosts: Lab, quick: str, verb: str
) -> None:
    """The command's own path (cli/ahead.py; --debug turns it off). A first run of the same command line keeps
    its logins and each host's first read-only command (logins.py; `down` has none). In the second, lab-h3's
    login starts from that record before the inventory is read and its first command runs ahead of the CLI;
    lab-h3 freezes while that command runs (a `docker` 4 s late, which leaves a mark first). The verb ends
    within its deadlines, exit 1, naming lab-h3 as having stopped answering (not a second login that found no
    banner: the run-ahead's failure used to send the CLI's call to log in again), and the next run does what
    the first did."""
    argv = [verb, "-i", quick, "--json"]  # as Lab.cli runs it: the record is kept per command line
    lab_hosts.sh("lab-h3", f"rm -f {CALLED}")
    before, _, _ = lab_hosts.cli(verb, inventory=quick)  # whatever it exits with, the record is kept
    record = json.loads(logins.cache_file(Path(quick).resolve()).read_text())
    first = record.get("first", {}).get(logins.command_line_key(argv), {})
    assert IP3 in record["logins"], record  # the login the second run starts before reading the inventory
    assert (IP3 in first) == (verb != "down"), record  # and the command run ahead (down begins by removing)
    with lab_hosts.shim("lab-h3", "docker", MARKED_SLOW_DOCKER):
        command = [sys.executable, "-m", "raycluster_cli", *argv]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            called = wait_until(lambda: lab_hosts.sh_result("lab-h3", f"test -e {CALLED}").returncode == 0, 60, 0.1)
            assert called, "lab-h3's docker was never called"
            freeze(lab_hosts, "lab-h3")
            frozen_at = time.monotonic()
            out, err = process.communicate(timeout=120)
            ended = time.monotonic()
        finally:
            thaw(lab_hosts, "lab-h3")
            if process.poll() is None:
                process.kill()
    assert process.returncode == 1, err
    assert ended - frozen_at <= KEEPALIVE_DEADLINE_S + LOGIN_DEADLINE_S + SLACK_S, (ended - frozen_at, err)
    assert "Traceback" not in err
    document = json.loads(out)
    text = str(document)
    assert IP3 in text and "stopped answering" in text, text
    if verb == "doctor":
        failed = [c for c in document["checks"] if c["status"] == "fail"]
        assert [c["host"] for c in failed] == [IP3], failed
    lab_hosts.sh("lab-h3", f"rm -f {CALLED}")
    code, doc, err = lab_hosts.cli(verb, inventory=quick)  # the host answers again: as before the freeze
    assert code == before and "stopped answering" not in str(doc), (code, before, doc)


def _no_stream_left(the_lab: Lab, timeout: float = 30) -> None:
    """Nothing of an interrupted image stream runs on lab-h3, and it has no (partial) image."""
    assert wait_until(lambda: not processes(the_lab, "lab-h3", OURS_ON_HOST), timeout), processes(
        the_lab, "lab-h3", OURS_ON_HOST
    )
    assert the_lab.sh_result("lab-h3", f"docker image inspect {lab.NODE_IMAGE}").returncode != 0


def _streaming_up(quick: str) -> Verb:
    """`up` started with the image missing on lab-h3; returns once the stream to it is under way."""
    verb = Verb("up", "--timeout", "120", inventory=quick)
    # The receive script (image/receive.py) is logged over several lines; its first names the staging step.
    verb.wait_for(rf"{IP3}: \$ exec bash -c 'set -o pipefail; umask 077;", timeout=900)  # the archive may be made first
    time.sleep(2)  # some of the image is on its way
    return verb


@pytest.mark.extended
def test_image_stream_frozen_cut_and_interrupted_then_the_rerun_completes(lab_hosts: Lab, quick: str) -> None:
    lab_hosts.cli("down", inventory=quick)
    lab_hosts.sh("lab-h3", f"docker rmi {lab.NODE_IMAGE}")

    # 1. The host freezes in the middle of the stream.
    verb = _streaming_up(quick)
    try:
        freeze(lab_hosts, "lab-h3")
        frozen_at = time.monotonic()
        code, doc, ended = verb.finish(timeout=300)
    finally:
        thaw(lab_hosts, "lab-h3")
    assert code == 1 and ended - frozen_at <= STALL_DEADLINE_S + KEEPALIVE_DEADLINE_S + SLACK_S, verb.stderr
    assert IP3 in doc["error"]["message"] and [h["host"] for h in doc["error"]["hosts"]] == [IP3]
    _no_stream_left(lab_hosts)

    # 2. The connection is cut in the middle of the stream (packets to sshd dropped on the host).
    verb = _streaming_up(quick)
    try:
        lab_hosts.sh("lab-h3", CUT)
        cut_at = time.monotonic()
        code, doc, ended = verb.finish(timeout=300)
        assert code == 1 and ended - cut_at <= STALL_DEADLINE_S + KEEPALIVE_DEADLINE_S + SLACK_S, verb.stderr
        assert [h["host"] for h in doc["error"]["hosts"]] == [IP3]
        # While the connection is still cut, the host's side ends by itself (its stdin stalled).
        _no_stream_left(lab_hosts, timeout=STALL_DEADLINE_S + 10 + SLACK_S)
    finally:
        lab_hosts.sh_result("lab-h3", UNCUT)

    # 3. Ctrl-C in the middle of the stream.
    verb = _streaming_up(quick)
    sent = verb.signal(signal.SIGINT)
    code, doc, ended = verb.finish(timeout=60)
    assert code == 130 and ended - sent <= 5, verb.stderr
    assert doc["ok"] is False and doc["interrupted"]["signal"] == "SIGINT"
    assert any(r["host"] == IP3 and "docker load" in r["command"] for r in doc["interrupted"]["running"]), doc
    assert "Traceback" not in verb.stderr
    assert verb.session_alive() == []  # nothing of ours left on this machine
    _no_stream_left(lab_hosts)

    # 4. The rerun streams the image and completes the cluster.
    code, doc, err = lab_hosts.cli("up", "--timeout", "180", inventory=quick, timeout=1500)
    assert code == 0, err
    assert all(n["alive"] for n in doc["nodes"]) and [t["host"] for t in doc["images"]] == [IP3]


def test_waiting_for_nodes_interrupted_then_the_rerun_completes(lab_hosts: Lab, quick: str) -> None:
    lab_hosts.cli("down", inventory=quick)

    # Ctrl-C while `up` waits for the workers to join.
    verb = Verb("up", "--timeout", "120", inventory=quick)
    verb.wait_for("waiting for every node to join", timeout=600)
    sent = verb.signal(signal.SIGINT)
    code, doc, ended = verb.finish(timeout=60)
    assert code == 130 and ended - sent <= 5, verb.stderr
    assert doc["ok"] is False and "Traceback" not in verb.stderr and verb.session_alive() == []
    assert wait_until(lambda: not processes(lab_hosts, "lab-h1", r"raycluster-guard"), 30)

    # The rerun completes the cluster.
    code, doc, err = lab_hosts.cli("up", "--timeout", "180", inventory=quick, timeout=900)
    assert code == 0, err
    assert all(n["alive"] for n in doc["nodes"])
