"""Ray node containers on a host: the `docker run` line, ownership labels, listing and removal.

Everything here is a command string built from the inventory plus a parser of Docker's output, so it is
unit-tested without Docker; `verbs/up.py` runs these commands through a transport.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass

from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.errors import OperationError
from raycluster_cli.host.engine import adapt_run_argv, dialect_for, ps_rows
from raycluster_cli.host.folders import cluster_dir, models_dir
from raycluster_cli.transport import Transport, quote, shell_path

LABEL_CLUSTER = "io.raycluster.cluster"
LABEL_ROLE = "io.raycluster.role"
LABEL_MANAGED = "io.raycluster.managed-by"
LABEL_CONFIG = "io.raycluster.config"
TOKEN_IN_CONTAINER = "/run/raycluster/auth-token"
ENV_IN_CONTAINER = "/run/raycluster/env"
MODELS_IN_CONTAINER = "/run/raycluster/models"  # the host's model cache, read-only (host/folders.models_dir)
# The container's command sources the env file first, so that the Ray processes get the inventory's
# `env` while the values stay out of `docker inspect` and every command line (`verbs/serve.py` sources it
# the same way).
SOURCE_ENV = f"set -a && . {ENV_IN_CONTAINER} && set +a"
# A worker's container waits until the head's GCS answers before `ray start`, so that `up` starts every worker
# while the head is still starting instead of after: `ray start --address` itself gives a GCS that is not there
# yet about 20 s, and looks for the head's node, and the session's name, only every 2 s. One Python process first
# imports what it and `ray start` need (Ray's GCS client and `ray start`'s entry point: about 1 CPU-second, half
# of it `ray start`'s own modules), then polls the port (no new process each time), and runs `ray start` in the
# same process, as Ray's own `ray` script does (no second import). One line in the container's log says it waits;
# one that it gave up (after GCS_WAIT_S: the container exits, `up` names why).
#
# Ray's `ray start` of a worker then reads the head's node record, for two things only: the head's temp folder
# (the worker's default) and session folder. The head registers its node last, after its dashboard, raylet and
# agents, so that lookup holds every worker back until the head is done, however early it started. In the mode
# "early" (see `early_start`) the wait reads the session's name, which the head writes right after its GCS
# starts, and answers that lookup itself while the head's node is not registered: the temp folder is Ray's own
# default in this container (RAY_TMPDIR, else TMPDIR, else /tmp, joined with "ray"), which is the head's because
# `up` chooses this mode only where the head and this worker give their containers the same values of those
# variables in the same image; the session folder is that temp folder joined with the session's name, as the
# head's is. The worker's raylet then starts as soon as the session is known, long before the head registers.
# Once the head's node is registered, Ray's own record is used. A Ray without these internals (another
# version) falls back to waiting for the head's node, and a Ray without the GCS client to `ray start` at once.
GCS_WAIT_S = 600
_WAIT_FOR_GCS = """import os, socket, sys, time
head, port, limit, mode, command = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5:]
try:
    from ray._raylet import GcsClient
    from ray.core.generated.gcs_service_pb2 import GetAllNodeInfoRequest
except Exception:
    GcsClient = None
early = mode == "early" and GcsClient is not None and command[:1] == ["ray"]
if command[:1] == ["ray"]:
    from ray.scripts.scripts import main
if early:
    try:
        import ray._private.node as node
        from ray._common.utils import get_default_ray_temp_dir
        from ray.core.generated.gcs_pb2 import GcsNodeInfo

        lookup = node.get_all_node_info_until_retrieved
        early = {"temp_dir", "session_dir"} <= set(GcsNodeInfo.DESCRIPTOR.fields_by_name)
    except Exception:
        early = False
end, said = time.monotonic() + limit, False
while True:
    try:
        socket.create_connection((head, port), 2).close()
        break
    except OSError:
        if time.monotonic() > end:
            sys.exit(f"raycluster: the GCS of the head at {head}:{port} did not answer within {limit:.0f}s")
        if not said:
            print(f"raycluster: waiting for the GCS of the head at {head}:{port}", flush=True)
            said = True
        time.sleep(0.2)
if GcsClient is not None:
    try:
        selector = GetAllNodeInfoRequest.NodeSelector(is_head_node=True)
        gcs = GcsClient(address=f"{head}:{port}")
        session = None
        while early and session is None and time.monotonic() < end:
            session = gcs.internal_kv_get(b"session_name", b"session", timeout=5)
            if session is None:
                time.sleep(0.1)
        early = session is not None
        while not early and not gcs.get_all_node_info(timeout=5, node_selectors=[selector]) and time.monotonic() < end:
            time.sleep(0.1)
    except Exception:
        early = False
if early:
    temp = get_default_ray_temp_dir()
    record = GcsNodeInfo(temp_dir=temp, session_dir=os.path.join(temp, session.decode()), state=GcsNodeInfo.ALIVE)

    def head_record(client, node_selectors=None, **options):
        if not node_selectors or not all(s.is_head_node for s in node_selectors):
            return lookup(client, node_selectors=node_selectors, **options)
        try:
            known = list(client.get_all_node_info(timeout=5, node_selectors=node_selectors).values())
        except Exception:
            known = []
        return known or [record]

    node.get_all_node_info_until_retrieved = head_record
if command[:1] == ["ray"]:
    sys.argv = command
    sys.exit(main())
os.execvp(command[0], command)
"""
# The environment variables that decide Ray's default temp folder in a container (ray._common.utils).
_TEMP_DIR_ENV = ("RAY_TMPDIR", "TMPDIR")


def early_start(inventory: Inventory, host: HostConfig) -> bool:
    """Whether `host`'s wait may answer Ray's lookup of the head's folders itself (see _WAIT_FOR_GCS): true
    when the head's container and this one resolve Ray's default temp folder alike, that is when the
    inventory's env gives both the same values of RAY_TMPDIR and TMPDIR, and their `docker.run_options` set
    the container's environment with the same options (or none). The image is the cluster's, the same."""
    head = inventory.head_host
    head_env, env = inventory.env_for(head), inventory.env_for(host)
    if any(head_env.get(name) != env.get(name) for name in _TEMP_DIR_ENV):
        return False
    return _env_options(inventory, head) == _env_options(inventory, host)


def _env_options(inventory: Inventory, host: HostConfig) -> list[str]:
    """The words of `host`'s run options that give the container environment (-e, --env, --env-file), each
    with its value, in order."""
    words = [word for option in inventory.docker_for(host).run_options for word in shlex.split(option)]
    picked: list[str] = []
    for index, word in enumerate(words):
        if word in ("-e", "--env", "--env-file"):
            picked += words[index : index + 2]
        elif word.startswith(("--env=", "--env-file=")) or (word.startswith("-e") and not word.startswith("--")):
            picked.append(word)
    return picked


# Every node's container restarts by itself when it exits or its engine starts again (a reboot, a restarted
# dockerd), unless an operator stopped it (`docker stop`/`kill`), which Docker remembers; `down` removes it for good
# (`docker rm -f`). A worker's raylet exits once its head's GCS has not answered for Ray's
# gcs_rpc_server_reconnect_timeout_s (60 s), and so does its container: restarted, it waits for the head again
# (GCS_WAIT_S, then exits and is restarted once more) and joins the head that came back. `on-failure` would not
# do: Docker's engine starts again only the containers of `always` and `unless-stopped`. Podman's
# podman-restart.service starts again at boot only those of `always` (engine.adapt_run_argv uses it there).
RESTART_POLICY = "unless-stopped"
# The service's record in the head's container (serve/revive.py): what `serve` deployed, written by its launcher
# once the service generates, removed by `serve --stop`. It lives in the container's own filesystem, which a
# restart keeps and `down` (or `up` replacing the head, a new cluster) removes with the container, as it removes
# the keys document and the TLS pair the service needs beside it (verbs/serve_keys.py).
REVIVE_RECORD = "/tmp/raycluster-serve-revive.json"


def start_script(inventory: Inventory, host: HostConfig) -> str:
    """The container's shell command (its arguments: `ray start …`): the env file, then, on a worker, the
    wait for the head's GCS, then `ray start`, in the container's main process. On the head, when the
    container holds the service's record (it started again after `serve`), the service's redeploy in the
    background first (serve/revive.py), then `ray start`."""
    if host.role == "head":
        gcs = f"{inventory.head_address}:{inventory.ray.port}"
        revive = shlex.join(["python3", "-m", "raycluster_cli.serve.revive", REVIVE_RECORD, f"--gcs={gcs}"])
        return f'{SOURCE_ENV} && {{ if [ -f {REVIVE_RECORD} ]; then {revive} & fi; }} && exec "$@"'
    mode = "early" if early_start(inventory, host) else "head"
    wait = shlex.join(
        ["python3", "-c", _WAIT_FOR_GCS, inventory.head_address, str(inventory.ray.port), str(GCS_WAIT_S), mode]
    )
    return f'{SOURCE_ENV} && exec {wait} "$@"'


def container_name(inventory: Inventory, host: HostConfig) -> str:
    return f"raycluster-{inventory.cluster}-{host.role}"


def host_state_dir(inventory: Inventory, host: HostConfig) -> str:
    """The folder on `host` holding this cluster's files (token, env files); see host/folders.py."""
    return cluster_dir(inventory, host)


def token_path_on_host(inventory: Inventory, host: HostConfig) -> str:
    return f"{host_state_dir(inventory, host)}/auth-token"


def env_path_on_host(inventory: Inventory, host: HostConfig) -> str:
    return f"{host_state_dir(inventory, host)}/{host.role}.env"


def env_file_content(env: dict[str, str]) -> bytes:
    """A POSIX shell file that exports `env` (values quoted), sorted so that equal envs give equal bytes."""
    return "".join(f"{name}={shlex.quote(value)}\n" for name, value in sorted(env.items())).encode()


def cpu_quota_of(run_options: list[str]) -> float | None:
    """The CPUs a container's run options allow (`--cpus=X`, or `--cpu-quota=Q` over `--cpu-period=P`, Docker's
    default period 100 ms), None when they set no quota.

    Ray advertises such a container's quota rounded down, so a host given half a core offers 0 CPUs and no
    ordinary task (1 CPU) can run on it; Ray's CPUs are scheduling slots, not cores, so `up` gives a host whose
    quota is under one core one slot unless the inventory sets `num_cpus`."""
    words = [word for option in run_options for word in shlex.split(option)]
    values: dict[str, str] = {}
    for index, word in enumerate(words):
        name, sep, value = word.partition("=")
        if name in ("--cpus", "--cpu-quota", "--cpu-period"):
            values[name] = value if sep else (words[index + 1] if index + 1 < len(words) else "")
    try:
        if "--cpus" in values:
            return float(values["--cpus"])
        if "--cpu-quota" in values and float(values["--cpu-quota"]) > 0:
            return float(values["--cpu-quota"]) / float(values.get("--cpu-period", "100000"))
    except ValueError:
        return None
    return None


def ray_start_args(inventory: Inventory, host: HostConfig) -> list[str]:
    ray = inventory.ray
    node_ip = inventory.node_ip(host)
    if host.role == "head":
        args = [
            "ray", "start", "--head", f"--port={ray.port}", f"--node-ip-address={node_ip}",
            f"--dashboard-host={node_ip}", f"--dashboard-port={ray.dashboard_port}",
            f"--ray-client-server-port={ray.client_port}",
        ]  # fmt: skip
    else:
        args = [
            "ray",
            "start",
            f"--address={inventory.head_address}:{ray.port}",
            f"--node-ip-address={node_ip}",
        ]
    if host.num_cpus is not None:
        args.append(f"--num-cpus={host.num_cpus:g}")
    elif (quota := cpu_quota_of(inventory.docker_for(host).run_options)) is not None and quota < 1:
        args.append("--num-cpus=1")  # Ray rounds a quota below one core down to 0 CPUs: no task could run there
    if host.num_gpus is not None:
        args.append(f"--num-gpus={host.num_gpus}")
    if host.resources:
        args.append("--resources=" + json.dumps(host.resources, sort_keys=True, separators=(",", ":")))
    if ray.object_store_memory:
        args.append(f"--object-store-memory={ray.object_store_memory}")
    args += [f"--min-worker-port={ray.min_worker_port}", f"--max-worker-port={ray.max_worker_port}"]
    args.append(f"--metrics-export-port={ray.metrics_export_port}")
    args.append("--block")
    return args


def config_hash(argv: list[str]) -> str:
    """A short digest of the `docker run` arguments: a changed option, resource or image name changes it."""
    return hashlib.sha256("\0".join(argv).encode()).hexdigest()[:16]


def docker_run_command(inventory: Inventory, host: HostConfig) -> str:
    """The `docker run` that starts the Ray node on `host` (host network, node IP pinned, labelled).

    The label io.raycluster.config carries a digest of everything else on the line, so that `up` sees
    when the inventory asks for another container than the running one.
    """
    argv = run_argv(inventory, host)
    return " ".join(_shell_word(word) for word in [*argv[:2], f"--label={LABEL_CONFIG}={config_hash(argv)}", *argv[2:]])


def _shell_word(word: str) -> str:
    """One argument quoted; a `--volume=~/…` source is the login user's home on the host ("$HOME"/…)."""
    if word.startswith("--volume=~/"):
        return "--volume=" + shell_path(word.removeprefix("--volume="))
    return quote(word)


# Ray Serve's settings in every node's container (the inventory's `env` and the run options may set them otherwise):
# the HTTP proxy calls the ingress over gRPC and gets its streamed chunks back that way, instead of through Ray's
# object references (half of Ray's RAY_SERVE_THROUGHPUT_OPTIMIZED; the other half, direct ingress, moves the
# service off its port). On the lab the proxy's and the ingress's CPU per token 20-43 % lower, 1.09-1.15x the
# output tokens/s at 1, 4 and 32 requests at once (docs/PERFORMANCE.md S25).
# And the proxy's own guard (serve/proxy_guard.py, through Ray Serve's proxy callback): request heads within a deadline,
# connections capped, bodies capped before any key is checked, no client opting out of the disconnect watch.
# And the proxy's health checked every 2 s, not Ray's 10: the controller replaces a dead proxy after 3 failed checks,
# so a killed proxy left the port dark for ~30 s (tests/local/test_serve_process_deaths.py); each check still has
# its 10 s timeout, so only a proxy that answers none of 3 in a row is replaced.
SERVE_ENV = {
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "raycluster_cli.serve.proxy_guard.guard",
    "RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S": "2",
}


def run_argv(inventory: Inventory, host: HostConfig) -> list[str]:
    docker = inventory.docker_for(host)
    argv = [
        "docker", "run", "--detach", "--init", f"--restart={RESTART_POLICY}", f"--name={container_name(inventory, host)}",
        "--network=host",
        f"--label={LABEL_CLUSTER}={inventory.cluster}", f"--label={LABEL_ROLE}={host.role}",
        f"--label={LABEL_MANAGED}=raycluster",
        f"--volume={env_path_on_host(inventory, host)}:{ENV_IN_CONTAINER}:ro",
        f"--volume={models_dir(inventory, host)}:{MODELS_IN_CONTAINER}:ro",
    ]  # fmt: skip
    if docker.shm_size:
        argv.append(f"--shm-size={docker.shm_size}")
    if host.hostname:
        argv.append(f"--hostname={host.hostname}")
    if inventory.ray.auth == "token":
        argv += [
            "--env=RAY_AUTH_MODE=token",
            f"--env=RAY_AUTH_TOKEN_PATH={TOKEN_IN_CONTAINER}",
            f"--volume={token_path_on_host(inventory, host)}:{TOKEN_IN_CONTAINER}:ro",
        ]
    argv += [f"--env={name}={value}" for name, value in SERVE_ENV.items()]
    for option in docker.run_options:
        argv += shlex.split(option)
    argv += [inventory.image, "sh", "-c", start_script(inventory, host), "sh"]
    argv += ray_start_args(inventory, host)
    return adapt_run_argv(dialect_for(inventory, host), argv)


@dataclass(frozen=True)
class Container:
    id: str
    name: str
    state: str  # running, exited, created, ...
    image: str
    labels: dict[str, str]

    @property
    def running(self) -> bool:
        return self.state == "running"


def list_command(inventory: Inventory) -> str:
    return (
        "docker ps --all --no-trunc --filter "
        + quote(f"label={LABEL_CLUSTER}={inventory.cluster}")
        + (" --format '{{json .}}'")
    )


def inspect_name_command(name: str) -> str:
    return "docker ps --all --no-trunc --filter " + quote(f"name=^{name}$") + " --format '{{json .}}'"


def parse_ps(text: str) -> list[Container]:
    """Parse `docker ps --format '{{json .}}'` of Docker (an object a line) or Podman (one array)."""
    return [Container(row.id, row.name, row.state, row.image, row.labels) for row in ps_rows(text)]


def list_cluster_containers(transport: Transport, inventory: Inventory) -> list[Container]:
    result = transport.run(list_command(inventory))
    if not result.ok:
        raise OperationError(f"{transport.host}: docker ps failed: {result.first_line()}", "check Docker on the host")
    try:
        found = parse_ps(result.stdout)
    except ValueError as exc:
        raise OperationError(
            f"{transport.host}: docker ps printed what raycluster cannot read ({exc})",
            "check Docker on the host: docker ps --all --format '{{json .}}'",
        ) from None
    return [c for c in found if c.labels.get(LABEL_CLUSTER) == inventory.cluster]
