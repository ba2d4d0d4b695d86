"""The engine read once per host: how many times a gather starts the `docker` CLI (counted by running the real
batch script under /bin/sh with a `docker` on PATH that logs each call), and the parsing of the three readings."""

from __future__ import annotations

import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from raycluster_cli.checks import Status, run_checks
from raycluster_cli.checks.catalog import IMAGE_ID, IP_ADDR
from raycluster_cli.config import inventory
from raycluster_cli.config.inventory import HostConfig
from raycluster_cli.host.engine_facts import image_command, parse_containers, parse_engine, parse_image, running
from raycluster_cli.host.facts import FactCache, HostContext
from raycluster_cli.host.node import CONTAINER
from raycluster_cli.transport import CommandResult

from .conftest import EXAMPLE

HEX = "ab" * 32
# A stand-in for the engine's CLI: each call appends its arguments to $DOCKER_LOG and answers like Docker 20.10
# (its `docker run` takes $DOCKER_RUN_S between its two lines, as a real one takes about a second).
FAKE_DOCKER = f"""#!/bin/sh
echo "$*" >> "$DOCKER_LOG"
case "$1 $2" in
  "info --format") printf '20.10.24\\n/var/lib/docker\\n{{"runc":{{"path":"runc"}}}}\\n' ;;
  "image inspect") echo "sha256:{HEX} 1984499298" ;;
  "ps --all") ;;
  "run --rm") printf 'python 3.11.2\\n'; sleep "${{DOCKER_RUN_S:-0}}"; printf 'ray 2.60.0\\n' ;;
  *) echo "fake docker: $*" >&2; exit 1 ;;
esac
"""


class ShellTransport:
    """Runs a command with this machine's /bin/sh and the fake `docker` first on PATH."""

    def __init__(self, host: str, env: dict[str, str]) -> None:
        self.host = host
        self.env = env

    def run(self, command: str, *, stdin: bytes | None = None, timeout: float | None = 120.0) -> CommandResult:
        done = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, timeout=timeout, env=self.env)
        return CommandResult(done.returncode, done.stdout, done.stderr)

    def close(self) -> None:
        pass


@pytest.fixture
def engine_log(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    log = tmp_path / "docker.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DOCKER_LOG": str(log)}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    return log, env


def _calls(log: Path) -> Counter[str]:
    """Each `docker` call by its verb (`image inspect` counted as `image`)."""
    lines = log.read_text().splitlines() if log.exists() else []
    return Counter(line.split()[0] for line in lines)


def test_doctor_starts_the_engines_cli_three_times_per_host(engine_log: tuple[Path, dict[str, str]]) -> None:
    """One `docker info`, one `docker image inspect`, one `docker ps -a` per host (it was 8: info ×2, image
    inspect ×3, ps ×3), plus one `docker run` the first time an image's versions are read (then cached)."""
    log, env = engine_log
    inv = inventory.parse(EXAMPLE)

    def connect(host: HostConfig) -> ShellTransport:
        return ShellTransport(str(host.address), env)

    hosts = len(inv.hosts)
    first = run_checks(inv, connect)
    by_id = {(r.host, r.id): r for r in first}
    checks = ("docker", "image", "image-runtime")
    assert all(by_id[(str(h.address), c)].status == Status.OK for h in inv.hosts for c in checks)
    calls = _calls(log)
    assert 1 <= calls.pop("run") <= hosts  # the fake hosts share one cache, read side by side
    assert calls == {"info": hosts, "image": hosts, "ps": hosts}
    log.unlink()
    run_checks(inv, connect)
    assert _calls(log) == {"info": hosts, "image": hosts, "ps": hosts}


def test_readers_side_by_side_of_one_versions_cache_all_get_the_versions(
    engine_log: tuple[Path, dict[str, str]],
) -> None:
    """Several readers of one host's cache at once (two verbs on one host; hosts whose home is one NFS share):
    each writes its own temporary file, so none loses its file to another's rename (they once shared one
    `.tmp`, and the loser failed the image-runtime check)."""
    _, env = engine_log
    env = {**env, "DOCKER_RUN_S": "0.3"}
    inv = inventory.parse(EXAMPLE)
    command = image_command(HostContext(inv, inv.hosts[0]))
    readers = [
        subprocess.Popen(["/bin/sh", "-c", command], stdout=subprocess.PIPE, text=True, env=env) for _ in range(6)
    ]
    outputs = [(r.communicate(timeout=60)[0], r.returncode) for r in readers]
    versions = "python 3.11.2\nray 2.60.0\n"
    assert all(rc == 0 and parse_image(CommandResult(rc, out, "")).versions == versions for out, rc in outputs)
    (cached,) = (Path(env["XDG_CACHE_HOME"]) / "raycluster").iterdir()  # no temporary file left behind
    assert cached.name == f"versions-{HEX}" and cached.read_text() == versions


def test_up_reads_its_container_with_one_more_engine_call(engine_log: tuple[Path, dict[str, str]]) -> None:
    """`up`'s preflight also needs its container (`docker inspect`, and `docker exec` only when it runs)."""
    log, env = engine_log
    inv = inventory.parse(EXAMPLE)
    cache = FactCache(inv, lambda host: ShellTransport(str(host.address), env))
    run_checks(inv, cache.connect, cache=cache, also=lambda ctx: [CONTAINER, IP_ADDR, IMAGE_ID])
    hosts = len(inv.hosts)
    calls = _calls(log)
    assert 1 <= calls.pop("run") <= hosts
    assert calls == {"info": hosts, "image": hosts, "ps": hosts, "inspect": hosts}
    assert all(cache.of(h).get(CONTAINER).container is None for h in inv.hosts)
    # Only Ray's processes cross the wire (and a count): not the gather's own, whose arguments hold its script.
    processes = cache.of(inv.hosts[0]).results["processes"].stdout
    assert "@@raycluster-facts" not in processes and " processes\n" in processes
    assert cache.of(inv.hosts[0]).result(IMAGE_ID).stdout == f"sha256:{HEX}\n"


def test_engine_reading_and_the_engines_refusal() -> None:
    out = '20.10.24\n/data/docker\n{"runc":{}}\n---\nFilesystem 1-blocks Used Available Capacity Mounted on\n'
    info = parse_engine(CommandResult(0, out, ""))
    assert (info.version, info.root, info.runtimes, info.answers) == ("20.10.24", "/data/docker", '{"runc":{}}', True)
    assert info.df.startswith("Filesystem")
    refused = parse_engine(CommandResult(1, "---\n", "permission denied while trying to connect"))
    assert not refused.answers and refused.root == "" and refused.result.stderr.startswith("permission denied")


def test_image_reading() -> None:
    found = parse_image(CommandResult(0, f"sha256:{HEX} 1984499298\n---\npython 3.11.2\nray 2.60.0\n", ""))
    assert (found.id, found.size, found.versions) == (f"sha256:{HEX}", 1984499298, "python 3.11.2\nray 2.60.0\n")
    assert parse_image(CommandResult(0, f"{HEX} 12\n---\n", "")).id == f"sha256:{HEX}"  # Podman's bare hex
    absent = parse_image(CommandResult(1, "no-image\n", "Error: No such image: x"))
    assert (absent.id, absent.size) == ("", None)


def test_containers_reading() -> None:
    rows = (
        '{"ID":"a1","Names":"raycluster-demo-head","State":"running","Image":"i",'
        '"Labels":"io.raycluster.cluster=demo,io.raycluster.role=head"}\n'
        '{"ID":"b2","Names":"old","State":"exited","Image":"i","Labels":"io.raycluster.cluster=demo"}\n'
    )
    found = parse_containers(CommandResult(0, rows, ""))
    assert [r.id for r in running(found, {"io.raycluster.cluster": "demo"})] == ["a1"]
    assert running(found, {"io.raycluster.role": "worker"}) == []
    assert parse_containers(CommandResult(1, "", "Cannot connect")) == []
    assert parse_containers(CommandResult(0, "not json\n", "")) == []


def test_a_derived_fact_is_computed_again_after_its_reading_is_refreshed() -> None:
    inv = inventory.parse(EXAMPLE)
    answers = iter([f"sha256:{'cd' * 32} 1\n---\n", f"sha256:{HEX} 1\n---\n"])

    class Host:
        host = "192.0.2.11"

        def run(self, command: str, **options: object) -> CommandResult:
            from raycluster_cli.transport.batch import fake_batch_output

            return fake_batch_output(command, lambda c: CommandResult(0, next(answers), ""))

        def close(self) -> None:
            pass

    cache = FactCache(inv, lambda host: Host())  # type: ignore[arg-type, return-value]
    head = inv.hosts[:1]
    cache.gather(head, lambda ctx: [IMAGE_ID])
    assert cache.of(head[0]).result(IMAGE_ID).stdout.startswith("sha256:cd")
    cache.gather(head, lambda ctx: [IMAGE_ID])  # already gathered: nothing runs
    cache.gather(head, lambda ctx: [IMAGE_ID], refresh=[IMAGE_ID])
    assert cache.of(head[0]).result(IMAGE_ID).stdout == f"sha256:{HEX}\n"
    assert isinstance(cache.of(head[0]).context, HostContext)
