"""Real faults on lab hosts for the fault tests: a frozen host (docker pause), a cut connection (iptables in
the host's namespace), and a `raycluster` process in a session of its own that a test can signal."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .conftest import DOCKER, Lab

# Short deadlines, so that every fault is noticed in seconds (documented in inventory.example.yaml).
QUICK_SSH = {
    "connect_timeout_s": 3,
    "connect_retries": 1,
    "keepalive_interval_s": 2,
    "keepalive_count_max": 3,
    "stall_timeout_s": 5,
}
# What each fault may take at most with QUICK_SSH: a login (2 × 3 s banner + ≤1.25 s pause, plus the
# TCP connect and auth of a live host) or a keepalive (2 s × 3) and a stall (5 s), plus this machine's load.
LOGIN_DEADLINE_S = 2 * 3 + 1.25
SLACK_S = 12


def quick_inventory(the_lab: Lab, path: Path) -> str:
    return the_lab.variant(path, lambda data: data["ssh"].update(QUICK_SSH))


@contextmanager
def frozen(the_lab: Lab, hostname: str) -> Iterator[None]:
    """The lab host frozen like a wedged kernel (its processes stop; TCP stays open) until the block ends."""
    name = the_lab.host(hostname).name
    pause(name)
    try:
        yield
    finally:
        subprocess.run([DOCKER, "unpause", name], capture_output=True)


def pause(name: str, tries: int = 3) -> None:
    """`docker pause` the container; the cgroup freezer can time out on a loaded machine (the engine then says
    so and the container runs on), so a failed pause is tried again, and the last error is shown."""
    for attempt in range(tries):
        done = subprocess.run([DOCKER, "pause", name], capture_output=True, text=True)
        if done.returncode == 0:
            return
        if attempt < tries - 1:
            time.sleep(1)
    raise AssertionError(f"docker pause {name} failed {tries} times: {done.stderr.strip()}")


def freeze(the_lab: Lab, hostname: str) -> None:
    pause(the_lab.host(hostname).name)


def thaw(the_lab: Lab, hostname: str) -> None:
    subprocess.run([DOCKER, "unpause", the_lab.host(hostname).name], capture_output=True)


CUT = "iptables -I INPUT -p tcp --dport 22 -j DROP"
UNCUT = "iptables -D INPUT -p tcp --dport 22 -j DROP"


def processes(the_lab: Lab, hostname: str, pattern: str) -> list[str]:
    """Command lines of the processes on a lab host that match `pattern` (read without SSH)."""
    out = the_lab.sh_result(hostname, "ps -eo args=").stdout
    return [line for line in out.splitlines() if re.search(pattern, line) and "ps -eo" not in line]


def wait_until(condition: Callable[[], bool], timeout: float, step: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return condition()


class Verb:
    """`raycluster VERB -i INV --json --debug [WORDS]` as a real process in its own session (as a shell with job
    control starts it, so SIGINT is delivered), with its stderr read line by line."""

    def __init__(self, *args: str, inventory: str, words: tuple[str, ...] = ()) -> None:
        command = [sys.executable, "-m", "raycluster_cli.cli", *args, "-i", inventory, "--json", "--debug", *words]
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=dict(os.environ),
        )
        self.lines: list[str] = []
        self._new = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        # stdout has a reader of its own: Popen.communicate() would also read stderr, and every line it took
        # would be missing from `lines` (seen: a restart's progress lines lost while finish() waited)
        self._out: list[str] = []
        self._out_reader = threading.Thread(target=self._read_out, daemon=True)
        self._out_reader.start()

    def _read_out(self) -> None:
        assert self.process.stdout is not None
        self._out.append(self.process.stdout.read())

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            with self._new:
                self.lines.append(line.rstrip("\n"))
                self._new.notify_all()

    def wait_for(self, pattern: str, timeout: float = 600) -> str:
        """The first stderr line matching `pattern` (waiting for it); fails if the process ends first."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._new:
            while True:
                for line in self.lines[seen:]:
                    if regex.search(line):
                        return line
                seen = len(self.lines)
                if self.process.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(f"exited {self.process.returncode} before {pattern!r}:\n" + self.stderr)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {pattern!r} within {timeout}s:\n" + self.stderr)
                self._new.wait(min(left, 0.5))

    def signal(self, number: int = signal.SIGINT) -> float:
        self.process.send_signal(number)
        return time.monotonic()

    def finish(self, timeout: float = 900) -> tuple[int, dict[str, Any], float]:
        """Exit code, the JSON document, and when it ended (monotonic)."""
        self.process.wait(timeout=timeout)
        ended = time.monotonic()
        self._reader.join(timeout=10)
        self._out_reader.join(timeout=10)
        out = "".join(self._out)
        try:
            document = json.loads(out)
        except ValueError:
            raise AssertionError(
                f"not one JSON document (rc={self.process.returncode}):\n{out}\n{self.stderr}"
            ) from None
        return self.process.returncode, document, ended

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)

    def session_alive(self) -> list[str]:
        """Processes still in this verb's session (children it left behind on this machine)."""
        done = subprocess.run(["ps", "-eo", "sid=,args="], capture_output=True, text=True)
        sid = str(self.process.pid)
        return [line for line in done.stdout.splitlines() if line.split(None, 1)[0] == sid]


# A machine that loses its power: first its network goes silent (every packet in and out of the lab host's
# namespace, where its Ray container lives, dropped, so the FIN/RST of its dying sockets never leave), then
# every process in it is killed. Its peers hear nothing more, as from a machine switched off.
SILENCE = "iptables -I INPUT -j DROP && iptables -I OUTPUT -j DROP"


def power_off(the_lab: Lab, hostname: str) -> None:
    the_lab.sh(hostname, SILENCE)
    subprocess.run([DOCKER, "kill", the_lab.host(hostname).name], check=True, capture_output=True)


def power_on(the_lab: Lab, hostname: str, timeout_s: float = 120.0) -> None:
    """Boot the lab host again (a fresh network namespace: no DROP rules) and wait for its engine."""
    subprocess.run([DOCKER, "start", the_lab.host(hostname).name], check=True, capture_output=True)
    ready = lambda: the_lab.sh_result(hostname, "docker info >/dev/null 2>&1").returncode == 0  # noqa: E731
    if wait_until(ready, timeout_s / 2):
        return
    # seen once in three boots: the engine never answered; its log says why, and a second start (stale pid
    # files of the killed engine removed, as a real boot's fresh /run would) is what an administrator would try
    log = the_lab.sh_result(hostname, "tail -5 /var/log/dockerd.log").stdout
    the_lab.sh_result(
        hostname, "rm -f /var/run/docker/containerd/containerd.pid && /usr/local/sbin/labhost-start-dockerd"
    )
    assert wait_until(ready, timeout_s / 2), f"{hostname}: its engine did not answer after boot: {log}"
    print(f"[power_on] {hostname}: the engine started on a second try; its log before: {log}")


@contextmanager
def dashboard(inventory: str) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """A real `raycluster dashboard --port 0 --json` and the document it prints once its forward listens (it
    stays until a signal); killed at the end if the test did not end it."""
    command = [sys.executable, "-m", "raycluster_cli.cli", "dashboard", "-i", inventory, "--port", "0", "--json"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        text = ""
        deadline = time.monotonic() + 120
        while not text.endswith("}\n") and time.monotonic() < deadline:
            text += process.stdout.readline()
        yield process, json.loads(text)
    finally:
        if process.poll() is None:
            process.kill()
