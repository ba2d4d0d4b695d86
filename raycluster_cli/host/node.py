"""One Ray node container on one host: the facts `up` reads there, what it must do, and the one command doing it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.config.state import token_file
from raycluster_cli.errors import OperationError
from raycluster_cli.host.containers import (
    ENV_IN_CONTAINER,
    LABEL_CLUSTER,
    LABEL_CONFIG,
    LABEL_ROLE,
    TOKEN_IN_CONTAINER,
    Container,
    config_hash,
    container_name,
    docker_run_command,
    run_argv,
    token_path_on_host,
)
from raycluster_cli.host.engine import image_id
from raycluster_cli.host.engine_facts import CONTAINERS, parse_containers
from raycluster_cli.host.facts import Fact, HostContext, derived, raw
from raycluster_cli.host.folders import cluster_dir, fix_hint, login_user, make_dir_command, models_dir, refusal
from raycluster_cli.host.parsers import parse_ip_addr
from raycluster_cli.transport import PART_SEPARATOR, CommandResult, Transport, quote, shell_path
from raycluster_cli.transport.sshio import DeadlineExceeded

DERIVED_ENV = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def node_env(inventory: Inventory, host: HostConfig, ip_addr_output: str) -> dict[str, str]:
    """The inventory's env for `host`, plus NCCL/GLOO_SOCKET_IFNAME = the NIC holding the node IP (pure).

    Collective libraries otherwise pick an interface by themselves, often docker0 or a management NIC.
    """
    env = inventory.env_for(host)
    ip = inventory.node_ip(host)
    nic = next((i.name for i in parse_ip_addr(ip_addr_output) if i.address == ip), None)
    for name in DERIVED_ENV:
        if nic and name not in env:
            env[name] = nic
    return env


@dataclass(frozen=True)
class ContainerView:
    """Our node container on a host as `up` needs it: the container (None: there is none), the image ID it
    runs, and the digest of the env and token files it started with (None: not running)."""

    container: Container | None
    image_id: str = ""
    files_digest: str | None = None
    token_digest: str | None = None  # SHA-256 of the Ray token it started with (None: no token, or not running)


def container_command(ctx: HostContext) -> str:
    """When the container named like ours runs: the image ID it runs and the digest of the files it read at
    start (bind mounts keep the file a container started with, even after `up` rewrote the host's copy).
    Whether it exists, its state and labels come from the host's one `docker ps -a` (enginefacts.CONTAINERS)."""
    name = quote(container_name(ctx.inventory, ctx.host))
    files = (
        f"cat {ENV_IN_CONTAINER} {TOKEN_IN_CONTAINER} 2>/dev/null | sha256sum; "
        f"if [ -f {TOKEN_IN_CONTAINER} ]; then printf 'token '; sha256sum < {TOKEN_IN_CONTAINER}; fi"
    )
    return (
        f"s=$(docker inspect --type container --format '{{{{.State.Running}}}} {{{{.Image}}}}' {name} 2>/dev/null)"
        f' && [ "${{s%% *}}" = true ] || exit 0; echo "${{s#* }}"; echo {PART_SEPARATOR}; '
        f"docker exec {name} sh -c {quote(files)}"
    )


def parse_container_view(ctx: HostContext, results: list[CommandResult]) -> ContainerView:
    """Our container from the host's containers (`docker ps -a`) and, when it runs, `container_command`'s output."""
    containers, running = results
    name = container_name(ctx.inventory, ctx.host)
    found = [r for r in parse_containers(containers) if r.name.lstrip("/") == name]
    if not found:
        return ContainerView(None)
    row = found[0]
    parts = running.stdout.split(PART_SEPARATOR)
    seen = image_id(parts[0])
    lines = [line.split() for line in parts[1].splitlines() if line.split()] if len(parts) > 1 else []
    digest = next((words[0] for words in lines if words[0] != "token"), None)
    token = next((words[1] for words in lines if words[0] == "token" and len(words) > 1), None)
    container = Container(row.id, row.name.lstrip("/"), row.state, row.image, row.labels)
    return ContainerView(container, seen, digest, token)


CONTAINER_RUNNING = raw("container-running", container_command)
CONTAINER: Fact[ContainerView] = derived("container", (CONTAINERS, CONTAINER_RUNNING), parse_container_view)


@dataclass(frozen=True)
class Plan:
    action: str  # "keep" / "start" / "replace"
    reason: str = ""


def token_digest(token: bytes | None) -> str | None:
    """What `container_command` prints for the token a container started with (a fingerprint, never the token)."""
    return hashlib.sha256(token).hexdigest() if token else None


def files_digest(env: bytes, token: bytes | None) -> str:
    """Digest of the files a container reads at start (env file, token file): the same digest is computed
    inside a running container, so a changed env or token is seen without either crossing the wire."""
    return hashlib.sha256(env + (token or b"")).hexdigest()


def plan_node(
    inventory: Inventory,
    host: HostConfig,
    view: ContainerView,
    image_id: str,
    digest: str,
    force: str = "",
    token: str | None = None,
) -> Plan:
    """What `up` must do on `host` (pure); refuse a container named like ours that this cluster did not start,
    and one of this cluster that runs with another Ray token than this machine's.

    `image_id` is the ID the inventory's image name has on the host now; `token` the digest of this machine's
    token (`token_digest`). Two operators (or two state folders) running `up` on one cluster each have their
    own token: replacing the other's containers would cut off its jobs and clients without a word, so the
    second is refused, with both fingerprints, until it takes the running cluster's token or `down`s it.
    """
    existing = view.container
    if existing is None:
        return Plan("start")
    if existing.labels.get(LABEL_CLUSTER) != inventory.cluster or existing.labels.get(LABEL_ROLE) != host.role:
        name = container_name(inventory, host)
        raise OperationError(
            f"{host.address}: a container named {name} exists that this cluster did not start",
            f"remove or rename it on {host.address} (docker rm -f {name}) if it is not needed",
        )
    if view.token_digest and token and view.token_digest != token and not force:
        raise OperationError(
            f"{host.address}: cluster {inventory.cluster}'s {host.role} container there runs with another Ray token "
            f"(SHA-256 {view.token_digest[:12]}…, this machine's {token[:12]}…): another operator, or `up` with "
            "another state folder, started it, and replacing it would cut off its jobs and clients",
            f"to work on that cluster, copy its token ({token_path_on_host(inventory, host)} on {host.address}) "
            f"to {token_file(inventory)}; to replace it, run `raycluster down` first",
        )
    ids = (view.image_id, image_id or "?")
    return Plan(*decide(existing, inventory, host, force, ids, view.files_digest, digest))


def decide(
    existing: Container,
    inventory: Inventory,
    host: HostConfig,
    force: str,
    image_ids: tuple[str, str],
    files_seen: str | None,
    files_wanted: str | None = None,
) -> tuple[str, str]:
    """(action, reason) for one of our own containers (pure). Our containers are replaced when what the
    inventory asks for changed; the reason says what changed."""
    if not existing.running:
        return "replace", f"container {existing.state}"
    if force:
        return "replace", force
    if existing.labels.get(LABEL_CONFIG) != config_hash(run_argv(inventory, host)):
        return "replace", "configuration changed (docker options, resources or Ray settings)"
    if image_ids[0] != image_ids[1]:
        return "replace", f"image changed ({image_ids[0][7:19]} → {image_ids[1][7:19]})"
    if files_wanted is not None and files_seen != files_wanted:
        return "replace", "env or auth token changed"
    return "keep", ""


_DIR_FAILED = 89
_WRITE_FAILED = 90
_RUN_FAILED = 91


def start_command(inventory: Inventory, host: HostConfig, plan: Plan, files: dict[str, bytes]) -> tuple[str, bytes]:
    """One remote command (and its stdin) that makes the host state folder (host/folders.py), writes `files` there
    (path → content, 0600, the data on stdin, never on a command line), then removes the old container if the
    plan replaces it and starts the new one."""
    # </dev/null: a `sudo -n install` (ssh.sudo) must not share our stdin; sudo (use_pty) makes it non-blocking,
    # and `dd` then fails with EAGAIN on data still on its way over SSH.
    folder = (
        f"{{ {make_dir_command(inventory, host)}; }} </dev/null "
        f"|| {{ echo 'raycluster: cannot make the folder' >&2; exit {_DIR_FAILED}; }}"
    )
    parts = ["umask 077", f"mkdir -p -- {shell_path(models_dir(inventory, host))}"]  # mounted: it must exist
    for path, data in files.items():
        tmp = shell_path(f"{path}.raycluster-tmp")
        # dd reads exactly its count from the shared stdin (a `head -c` could read ahead into the next file)
        parts.append(
            f"dd bs=1 count={len(data)} of={tmp} 2>/dev/null && chmod 600 {tmp} && mv -f -- {tmp} {shell_path(path)}"
        )
    write = " && ".join(parts) + f" || {{ echo 'raycluster: cannot write its files' >&2; exit {_WRITE_FAILED}; }}"
    stdin = b"".join(files.values())
    if plan.action == "keep":
        return f"{folder}; {write}", stdin
    name = quote(container_name(inventory, host))
    remove = f"docker rm -f {name} >/dev/null 2>&1; " if plan.action == "replace" else ""
    return f"{folder}; {write}; {remove}{docker_run_command(inventory, host)} || exit {_RUN_FAILED}", stdin


def apply(transport: Transport, inventory: Inventory, host: HostConfig, plan: Plan, files: dict[str, bytes]) -> str:
    """Carry out a plan in one remote command; return the action taken (running / started / restarted)."""
    command, stdin = start_command(inventory, host, plan, files)
    result = transport.run(command, stdin=stdin, timeout=120)
    refused = refusal(inventory, host, result.stderr, "raycluster will not use it")
    if result.rc == _DIR_FAILED and refused is not None:
        raise refused
    if result.rc == _DIR_FAILED:
        raise OperationError(
            f"{host.address}: cannot create {cluster_dir(inventory, host)} as {login_user(inventory, host)}: "
            f"{result.first_line()}",
            fix_hint(inventory, host),
        )
    if result.rc == _WRITE_FAILED:
        raise OperationError(
            f"{host.address}: cannot write {', '.join(files)}: {result.first_line()}", "check disk and permissions"
        )
    if not result.ok:
        raise OperationError(
            f"{host.address}: docker run failed: {result.first_line()}",
            "check the image and docker.run_options in the inventory",
        )
    return {"keep": "running", "start": "started"}.get(plan.action, "restarted")


# `ray start` prints this once its node is registered in the GCS (ray/_private/node.py waits for that before
# returning): a head that said it accepts drivers and workers; one that did not may still refuse them.
RAY_STARTED = "Ray runtime started."
EXITED = 3
TIMED_OUT = 4
PAUSED = 5
# A node not registered after this many quarter-second turns (about 15 s; a node registers in 4–10 s on a loaded
# lab) has its container asked whether it is paused, every 20 turns; paused twice in a row ends the wait.
_PAUSE_AFTER = 60
_PAUSE_EVERY = 20


def started_command(inventory: Inventory, host: HostConfig, timeout_s: float) -> str:
    """A loop on the host: until its container's log says its Ray node is registered (exit 0), the container
    stops running (exit 3), is found paused twice about 5 s apart once the wait has lasted about 15 s (exit 5:
    a frozen container's process stays in /proc, and nothing else would end the wait before `timeout_s`) or
    `timeout_s` passes (exit 4); then the container's last log lines. A container
    that is not running at the start is exit 3 even if its log says registered: a container `up` kept has
    that line from its first start, and may have exited since.

    It reads the container's log file itself (grep, every quarter second) and checks the container's first
    process in /proc (every half second), after one `docker inspect` for both: a loop of docker CLI calls
    (the log and the state, about six a second per host) cost a Ray start on a 2-core lab 9 CPU-seconds in
    all, taken from the nodes it waited for. Where the log file cannot be read (another log driver, a login
    that is not root) it asks `docker logs`, and where the process is gone it asks the engine before it says
    the container exited. No Python start-up competes with the starting node either way."""
    name = quote(container_name(inventory, host))
    tail = f"docker logs --tail 3 {name} 2>&1"
    logged = quote(RAY_STARTED)
    return (
        f"end=$(( $(date +%s) + {max(0, int(timeout_s))} )); "
        f"set -- $(docker inspect --format '{{{{.State.Pid}}}} {{{{.State.Running}}}} {{{{.LogPath}}}}' {name} "
        f"2>/dev/null); "
        f'[ "${{2:-}}" = false ] && {{ {tail}; exit {EXITED}; }}; '
        f'p=${{1:-0}}; l=${{3:-}}; [ -n "$l" ] && [ -r "$l" ] || l=; n=0; z=0; while :; do '
        f'if [ -n "$l" ]; then grep -qF {logged} "$l" && exit 0; '
        f"else docker logs {name} 2>&1 | grep -qF {logged} && exit 0; fi; n=$((n + 1)); "
        f"if [ $((n % 2)) = 1 ]; then "
        f'{{ [ "$p" != 0 ] && [ -e "/proc/$p" ]; }} '
        f"|| [ \"$(docker inspect --format '{{{{.State.Running}}}}' {name} 2>/dev/null)\" = true ] "
        f"|| {{ {tail}; exit {EXITED}; }}; "
        f'[ "$(date +%s)" -ge "$end" ] && {{ {tail}; exit {TIMED_OUT}; }}; fi; '
        f"if [ $n -ge {_PAUSE_AFTER} ] && [ $((n % {_PAUSE_EVERY})) = 0 ]; then "
        f"if [ \"$(docker inspect --format '{{{{.State.Paused}}}}' {name} 2>/dev/null)\" = true ]; then z=$((z + 1)); "
        f"[ $z -ge 2 ] && {{ {tail}; exit {PAUSED}; }}; else z=0; fi; fi; sleep 0.25; done"
    )


def wait_started(transport: Transport, inventory: Inventory, host: HostConfig, timeout_s: float) -> CommandResult:
    """Until the host's Ray node is registered (one remote command); the result says how it ended (rc 0, 3, 4)."""
    return transport.run(started_command(inventory, host, timeout_s), timeout=timeout_s + 60)


def start_failure(inventory: Inventory, host: HostConfig, result: CommandResult, timeout_s: float) -> OperationError:
    """The error naming why a node did not start, from `wait_started`'s result."""
    name = container_name(inventory, host)
    log_tail = " | ".join(line.strip() for line in result.stdout.splitlines() if line.strip())[-300:]
    last = log_tail or "(no log)"
    if result.rc == EXITED:
        what = f"the {host.role} container exited"
    elif result.rc == PAUSED:
        return OperationError(
            f"{host.address}: the {host.role}'s container {name} is paused (docker pause, or a freezer cgroup), so its"
            f" Ray node cannot register" + (f": {log_tail}" if log_tail else ""),
            f"run `docker unpause {name}` on {host.address} (or find what paused it), then re-run `raycluster up`",
        )
    elif result.rc == TIMED_OUT:
        what = f"the {host.role}'s Ray node did not start within {timeout_s:.0f}s"
    else:
        what = f"cannot wait for the {host.role}'s Ray node: {result.first_line()}"
    return OperationError(f"{host.address}: {what}: {last}", f"see `docker logs {name}` on {host.address}")


# `up` asks the GCS while the nodes register; the probe that asks, in a node's container, notes its PID in a file
# named by its look (`cancellable`, a key), so that `up` can end it early when a node failed (see cancel_probe).
# An end asked before the probe started is a second file it finds at its start. Each look removes the files of
# the looks before it in that container.
_LOOK_FILES = "/tmp/raycluster-look-"


def _look_wrapper(key: str) -> str:
    """The command that runs the probe (its arguments) in the container as a look that `cancel_probe` can end."""
    mine = f"{_LOOK_FILES}{key}"
    script = (
        f'for f in {_LOOK_FILES}*; do case "$f" in {mine}.*) ;; *) rm -f "$f" ;; esac; done; '
        f'echo $$ >{mine}.pid && {{ [ -e {mine}.end ] && exit 143; exec "$@"; }}'
    )
    return "sh -c " + quote(script) + " sh "


def probe(
    transport: Transport,
    inventory: Inventory,
    expect: list[str],
    timeout_s: float,
    stale: list[str] | None = None,
    cancellable: str = "",
    host: HostConfig | None = None,
) -> list[dict[str, Any]]:
    """The cluster's nodes, after waiting (up to `timeout_s`) for `expect` to be live and `stale` dead.

    `cancellable`: a key (letters and digits) naming this look; `cancel_probe` with it ends the probe, whether it
    runs already or not (its caller then gets an OperationError).
    `host`: asked from that worker's container (its node's GCS connection is the head's GCS too) once its node
    registered (the same wait as `wait_started`, in the same remote command); from the head's by default.
    """
    on = host or inventory.head_host
    name = container_name(inventory, on)
    gcs = f"{inventory.head_address}:{inventory.ray.port}"
    note = _look_wrapper(cancellable) if cancellable else ""
    command = (
        f"docker exec {quote(name)} {note}python -m raycluster_cli.host.probe --address {quote(gcs)} "
        f"--expect {quote(','.join(expect))} --stale-ids {quote(','.join(stale or []))} --timeout {timeout_s:.0f}"
    )
    if on is not inventory.head_host:
        command = f"( {started_command(inventory, on, timeout_s)} ) >/dev/null 2>&1 && {command}"
    try:
        result = transport.run(command, timeout=timeout_s + 60)
    except DeadlineExceeded:
        # A probe that never answers: a head container frozen while asked (`docker exec` then waits) says so.
        if _paused(transport, name):
            raise _paused_error(on, name) from None
        raise
    if result.rc != 0 and "is paused" in result.stderr:  # Docker refuses an exec into a paused container
        raise _paused_error(on, name)
    # The probe's stdout is its one document (Ray's output: stderr); an older node image's probe printed Ray's
    # output to stdout first, so its last line is read (the CLI and the image can be of different versions).
    lines = result.stdout.strip().splitlines()
    try:
        document = json.loads(lines[-1]) if lines else None
    except ValueError:
        document = None
    if not isinstance(document, dict):
        raise OperationError(
            f"{on.address}: cannot read the cluster's nodes: {result.first_line()}", f"see `docker logs {name}`"
        )
    nodes = document.get("nodes")
    if not isinstance(nodes, list):
        said = document.get("error") if "nodes" not in document else f"a node list that is not a list: {nodes!r:.80}"
        raise OperationError(f"{on.address}: {said}", f"see `docker logs {name}`")
    return [n for n in nodes if isinstance(n, dict)]


def _paused(transport: Transport, name: str) -> bool:
    """Whether the container is paused (`docker pause`, a freezer cgroup): one engine call, False if unknown."""
    try:
        done = transport.run(f"docker inspect --format '{{{{.State.Paused}}}}' {quote(name)}", timeout=30)
    except Exception:
        return False
    return done.rc == 0 and done.stdout.strip() == "true"


def _paused_error(host: HostConfig, name: str) -> OperationError:
    what = "its GCS cannot answer" if host.role == "head" else "it cannot ask the head's GCS"
    return OperationError(
        f"{host.address}: the {host.role}'s container {name} is paused, so {what} for the cluster's nodes",
        f"run `docker unpause {name}` on {host.address} (or find what paused it), then `raycluster down` and "
        "`raycluster up` (Ray's processes in a container frozen this long may not outlive the pause)",
    )


def cancel_probe(transport: Transport, inventory: Inventory, key: str, host: HostConfig | None = None) -> None:
    """End the probe of look `key` in the container of `host` (the head's by default; one remote command):
    the probe if it runs, or its start if it has not started yet."""
    name = container_name(inventory, host or inventory.head_host)
    mine = f"{_LOOK_FILES}{key}"
    end = f"touch {mine}.end; kill $(cat {mine}.pid 2>/dev/null) 2>/dev/null; true"
    transport.run(f"docker exec {quote(name)} sh -c {quote(end)}", timeout=30)
