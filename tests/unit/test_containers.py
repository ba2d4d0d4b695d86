import shlex
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.host import containers
from raycluster_cli.host.containers import (
    ENV_IN_CONTAINER,
    GCS_WAIT_S,
    LABEL_CLUSTER,
    LABEL_CONFIG,
    TOKEN_IN_CONTAINER,
    config_hash,
    container_name,
    docker_run_command,
    env_file_content,
    parse_ps,
    run_argv,
    start_script,
)


def test_head_run_command(example_yaml: str) -> None:
    inv = inventory.parse(example_yaml)
    argv = shlex.split(docker_run_command(inv, inv.head_host))
    assert argv[:2] == ["docker", "run"]
    assert "--network=host" in argv
    assert f"--label={LABEL_CLUSTER}=demo" in argv
    assert "--name=raycluster-demo-head" in argv
    ray = argv[argv.index("raycluster/node:0.1.0") + 1 :]
    assert ray[:2] == ["sh", "-c"] and f". {ENV_IN_CONTAINER}" in ray[2] and ray[2].endswith('exec "$@"')
    ray = ray[4:]
    assert ray[:4] == ["ray", "start", "--head", "--port=6379"]
    assert "--node-ip-address=192.0.2.11" in ray
    assert "--dashboard-host=192.0.2.11" in ray
    assert ray[-1] == "--block"
    assert f"--env=RAY_AUTH_TOKEN_PATH={TOKEN_IN_CONTAINER}" in argv
    assert any(a.startswith("--volume=/etc/raycluster/demo/auth-token:") and a.endswith(":ro") for a in argv)


def test_worker_run_command_has_host_options(example_yaml: str) -> None:
    inv = inventory.parse(example_yaml)
    worker = inv.hosts[2]
    argv = shlex.split(docker_run_command(inv, worker))
    assert "--cpus=0.5" in argv
    assert argv.index("--cpus=0.5") < argv.index("raycluster/node:0.1.0")
    assert "--address=192.0.2.11:6379" in argv
    assert "--node-ip-address=192.0.2.13" in argv
    assert container_name(inv, worker) == "raycluster-demo-worker"


def test_serves_proxy_calls_the_ingress_over_grpc_unless_the_run_options_say_otherwise(example_yaml: str) -> None:
    """Ray Serve's setting goes in before the inventory's run options (docker keeps the last of a name) and the
    inventory's env file is sourced after both, so either may set it otherwise."""
    inv = inventory.parse(example_yaml)
    for host in inv.hosts:
        argv = run_argv(inv, host)
        assert argv.count("--env=RAY_SERVE_PROXY_USE_GRPC=1") == 1
        # Ray Serve's proxy runs with raycluster's guard (serve/proxy_guard.py) on every node
        assert argv.count("--env=RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=raycluster_cli.serve.proxy_guard.guard") == 1
        # a dead proxy is replaced after 3 failed checks 2 s apart, not 10 (tests/local/test_serve_process_deaths.py)
        assert argv.count("--env=RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S=2") == 1
    worker = run_argv(inv, inv.hosts[2])
    assert worker.index("--env=RAY_SERVE_PROXY_USE_GRPC=1") < worker.index("--cpus=0.5")  # its run option


def test_no_token_when_auth_none(example_yaml: str) -> None:
    inv = inventory.parse(example_yaml + "ray: {auth: none}\n")
    assert "RAY_AUTH" not in docker_run_command(inv, inv.head_host)


def test_parse_ps() -> None:
    line = (
        '{"ID":"abc","Names":"raycluster-demo-head","State":"running","Image":"raycluster/node:0.1.0",'
        '"Labels":"io.raycluster.cluster=demo,io.raycluster.role=head,org.opencontainers.image.title=raycluster node"}'
    )
    (container,) = parse_ps(line + "\n\n")
    assert container.running
    assert container.labels["io.raycluster.role"] == "head"
    assert container.labels["org.opencontainers.image.title"] == "raycluster node"


def test_worker_port_range_reaches_ray_start(example_yaml: str) -> None:
    inv = inventory.parse(
        example_yaml.replace("\nhosts:", "\nray: {min_worker_port: 30000, max_worker_port: 30999}\nhosts:")
    )
    for host in inv.hosts:
        argv = shlex.split(docker_run_command(inv, host))
        assert "--min-worker-port=30000" in argv and "--max-worker-port=30999" in argv


def test_config_label_changes_with_options_resources_and_image(example_yaml: str) -> None:
    inv = inventory.parse(example_yaml)
    worker = inv.hosts[1]
    label = next(a for a in shlex.split(docker_run_command(inv, worker)) if a.startswith(f"--label={LABEL_CONFIG}="))
    assert label.endswith("=" + config_hash(run_argv(inv, worker)))
    variants = [
        example_yaml.replace(
            "- {address: 192.0.2.12, role: worker}", "- {address: 192.0.2.12, role: worker, resources: {a: 1}}"
        ),
        example_yaml.replace(
            "- {address: 192.0.2.12, role: worker}", "- {address: 192.0.2.12, role: worker, num_cpus: 2}"
        ),
        example_yaml.replace("image: raycluster/node:0.1.0", "image: raycluster/node:0.2.0"),
        example_yaml + "docker: {shm_size: 4g}\n",
    ]
    hashes = {config_hash(run_argv(inv, worker))}
    for text in variants:
        changed = inventory.parse(text)
        hashes.add(config_hash(run_argv(changed, changed.hosts[1])))
    assert len(hashes) == len(variants) + 1
    # env values are not part of the line (nor of its digest): they travel in the env file
    with_env = inventory.parse(example_yaml + "env: {SECRET: s3cr3t}\n")
    assert "s3cr3t" not in docker_run_command(with_env, with_env.hosts[1])
    assert config_hash(run_argv(with_env, with_env.hosts[1])) == config_hash(run_argv(inv, worker))


def test_resources_become_one_json_argument(example_yaml: str) -> None:
    text = example_yaml.replace(
        "- {address: 192.0.2.12, role: worker}",
        "- {address: 192.0.2.12, role: worker, resources: {special: 2, b: 0.5}}",
    )
    inv = inventory.parse(text)
    argv = shlex.split(docker_run_command(inv, inv.hosts[1]))
    assert '--resources={"b":0.5,"special":2.0}' in argv


def test_env_file_quotes_values_and_sorts() -> None:
    content = env_file_content({"B": "two words", "A": "it's"}).decode()
    assert content == "A='it'\"'\"'s'\nB='two words'\n"


def test_a_workers_container_sources_its_env_then_runs_the_wait_with_ray_starts_arguments(
    example_yaml: str, tmp_path: Path
) -> None:
    """The worker's container command under a real /bin/sh (python3 is a fake that records its arguments): the
    env file, then the wait (the head's GCS address, its limit) in the container's main process, handed
    `ray start` and its arguments to run."""
    inv = inventory.parse(example_yaml)
    script = start_script(inv, inv.hosts[1]).replace(ENV_IN_CONTAINER, str(tmp_path / "env"))
    (tmp_path / "env").write_text("A=from-env-file\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(
        '#!/bin/sh\necho "A=$A $1 $3 $4 $5 $6" >"$D/calls"; shift 6; echo "$*" >>"$D/calls"\n'
    )
    (bin_dir / "python3").chmod(0o755)
    done = subprocess.run(
        ["/bin/sh", "-c", script, "sh", "ray", "start", "--block"],
        capture_output=True,
        text=True,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "D": str(tmp_path)},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == [f"A=from-env-file -c 192.0.2.11 6379 {GCS_WAIT_S} early", "ray start --block"]
    head_script = start_script(inv, inv.head_host)
    assert head_script.endswith('exec "$@"')


def _wait_code(example_yaml: str) -> str:
    inv = inventory.parse(example_yaml)
    argv = shlex.split(start_script(inv, inv.hosts[1]).split(" && ")[3].removeprefix("exec "))
    assert argv[:2] == ["python3", "-c"]
    return argv[2]


class _FakeRay:
    """The parts of Ray the wait uses, as modules in sys.modules: a GCS client that knows the head's node from
    its `known_after`-th answer on and the session's name from its `session_after`-th, Ray's lookup of the
    head's node (`ray._private.node`), and `ray start`'s entry point, which records its argv and, as Ray's
    `ray start` of a worker does, looks up the head's node through `ray._private.node` (what it got:
    `looked_up`). `with_internals=False`: a Ray without that lookup (another version)."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        known_after: int,
        with_client: bool = True,
        session_after: int = 1,
        with_internals: bool = True,
    ) -> None:
        self.asked = 0
        self.kv_asked = 0
        self.address = ""
        self.started: list[str] = []
        self.looked_up: list[object] = []
        self.events: list[str] = []  # the import of `ray start`'s entry point, each connect: in order
        self.head = object()
        fake = self

        class GcsClient:
            def __init__(self, address: str) -> None:
                fake.address = fake.address or address  # the wait's client; `ray start`'s own comes second

            def get_all_node_info(self, timeout: float, node_selectors: list[object]) -> dict[str, object]:
                fake.asked += 1
                return {"head": fake.head} if fake.asked >= known_after else {}

            def internal_kv_get(self, key: bytes, namespace: bytes, timeout: float | None = None) -> bytes | None:
                assert (key, namespace, timeout) == (b"session_name", b"session", 5)  # never Ray's unbounded default
                fake.kv_asked += 1
                return b"session_7" if fake.kv_asked >= session_after else None

        class NodeSelector:
            def __init__(self, is_head_node: bool) -> None:
                self.is_head_node = is_head_node

        class GcsNodeInfo:
            DESCRIPTOR = types.SimpleNamespace(fields_by_name={"temp_dir": 1, "session_dir": 2, "state": 3})
            ALIVE = 0

            def __init__(self, **fields: object) -> None:
                self.fields = fields

        def ray_lookup(client: object, node_selectors: object = None, **options: object) -> list[object]:
            return ["Ray's own lookup"]

        def main() -> int:
            fake.started = list(sys.argv)
            node = sys.modules["ray._private.node"]
            if hasattr(node, "get_all_node_info_until_retrieved"):
                head = NodeSelector(is_head_node=True)
                fake.looked_up = node.get_all_node_info_until_retrieved(
                    GcsClient("again"), timeout_per_retry=5, node_selectors=[head]
                )
            return 0

        def entry_point(name: str) -> object:  # `from ray.scripts.scripts import main` says when it ran
            if name != "main":
                raise AttributeError(name)
            fake.events.append("import ray start")
            return main

        self.ray_lookup = ray_lookup
        self.GcsClient, self.NodeSelector = GcsClient, NodeSelector
        request = type("GetAllNodeInfoRequest", (), {"NodeSelector": NodeSelector})
        internals = {"get_all_node_info_until_retrieved": ray_lookup} if with_internals else {}
        modules: dict[str, dict[str, object]] = {
            "ray": {},
            "ray._raylet": {"GcsClient": GcsClient} if with_client else {},
            "ray._private": {},
            "ray._private.node": internals,
            "ray._common": {},
            "ray._common.utils": {"get_default_ray_temp_dir": lambda: "/fake-tmp/ray"},
            "ray.core": {},
            "ray.core.generated": {},
            "ray.core.generated.gcs_pb2": {"GcsNodeInfo": GcsNodeInfo},
            "ray.core.generated.gcs_service_pb2": {"GetAllNodeInfoRequest": request},
            "ray.scripts": {},
            "ray.scripts.scripts": {"__getattr__": entry_point},
        }
        for name, attributes in modules.items():
            module = types.ModuleType(name)
            module.__dict__.update(attributes)
            monkeypatch.setitem(sys.modules, name, module)


def test_the_wait_polls_one_process_asks_for_the_heads_node_then_runs_ray_start_in_it(
    example_yaml: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The wait's Python run in this process with the socket, the clock and Ray faked (no connection is
    opened): the port until it answers (one line says so), the head's node until the GCS knows it, then
    `ray start` in the same process."""
    code = _wait_code(example_yaml)
    tries: list[tuple[str, int]] = []
    clock = [0.0]

    def connect(address: tuple[str, int], timeout: float) -> socket.socket:
        tries.append(address)
        ray.events.append("connect")
        if len(tries) < 4:
            raise ConnectionRefusedError(111, "refused")
        return socket.socket()  # never connected: closed at once

    monkeypatch.setattr(socket, "create_connection", connect)
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(sys, "argv", ["-c", "192.0.2.11", "6379", "600", "head", "ray", "start", "--block"])
    ray = _FakeRay(monkeypatch, known_after=3)
    with pytest.raises(SystemExit) as ended:
        exec(compile(code, "<wait>", "exec"), {})
    assert ended.value.code == 0
    assert tries == [("192.0.2.11", 6379)] * 4
    # `ray start`'s modules are imported before the wait, while the head starts, not after its node is known.
    assert ray.events == ["import ray start"] + ["connect"] * 4
    assert capsys.readouterr().out == "raycluster: waiting for the GCS of the head at 192.0.2.11:6379\n"
    assert (ray.address, ray.asked, ray.started) == ("192.0.2.11:6379", 3, ["ray", "start", "--block"])
    assert (ray.kv_asked, ray.looked_up) == (0, ["Ray's own lookup"])  # the mode "head": Ray's lookup as it is

    # A Ray without that GCS client (another version): `ray start` at once, which looks for the head itself.
    monkeypatch.setattr(sys, "argv", ["-c", "192.0.2.11", "6379", "600", "early", "ray", "start", "--block"])
    other = _FakeRay(monkeypatch, known_after=1, with_client=False)
    with pytest.raises(SystemExit):
        exec(compile(code, "<wait>", "exec"), {})
    assert (other.asked, other.kv_asked, other.started) == (0, 0, ["ray", "start", "--block"])
    assert other.looked_up == ["Ray's own lookup"]

    monkeypatch.setattr(socket, "create_connection", lambda a, t: (_ for _ in ()).throw(OSError("unreachable")))
    monkeypatch.setattr(sys, "argv", ["-c", "192.0.2.11", "6379", "1", "early", "ray", "start"])
    with pytest.raises(SystemExit) as ended:
        exec(compile(code, "<wait>", "exec"), {})
    assert str(ended.value) == "raycluster: the GCS of the head at 192.0.2.11:6379 did not answer within 1s"


def test_the_early_wait_answers_rays_lookup_of_the_heads_folders_until_the_head_registers(
    example_yaml: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mode "early": once the GCS answers, the wait polls for the session's name (the head writes it right
    after its GCS starts) and runs `ray start` without waiting for the head's node. Ray's lookup of the head's
    node then gets the head's folders (Ray's default temp folder in this container, the session's folder in
    it) while the head is not registered, the head's own record once it is, and Ray's own lookup for any other
    question. A Ray without that lookup waits for the head's node as in the mode "head"."""
    code = _wait_code(example_yaml)
    clock = [0.0]
    monkeypatch.setattr(socket, "create_connection", lambda address, timeout: socket.socket())
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    argv = ["-c", "192.0.2.11", "6379", "600", "early", "ray", "start", "--block"]

    def run(ray: _FakeRay) -> None:
        monkeypatch.setattr(sys, "argv", list(argv))
        with pytest.raises(SystemExit) as ended:
            exec(compile(code, "<wait>", "exec"), {})
        assert ended.value.code == 0
        assert ray.started == ["ray", "start", "--block"]

    unregistered = _FakeRay(monkeypatch, known_after=100, session_after=3)
    run(unregistered)
    assert unregistered.kv_asked == 3
    # Only `ray start`'s lookup asked for the head's node: the wait did not wait for it.
    assert unregistered.asked == 1
    [record] = unregistered.looked_up
    assert record.fields == {"temp_dir": "/fake-tmp/ray", "session_dir": "/fake-tmp/ray/session_7", "state": 0}
    lookup = sys.modules["ray._private.node"].get_all_node_info_until_retrieved
    assert lookup is not unregistered.ray_lookup
    client = unregistered.GcsClient("again")
    assert lookup(client, node_selectors=[unregistered.NodeSelector(is_head_node=False)]) == ["Ray's own lookup"]
    assert lookup(client, timeout_per_retry=5) == ["Ray's own lookup"]

    registered = _FakeRay(monkeypatch, known_after=1)
    run(registered)
    assert registered.looked_up == [registered.head]

    other = _FakeRay(monkeypatch, known_after=3, with_internals=False)
    run(other)
    assert (other.kv_asked, other.asked, other.looked_up) == (0, 3, [])


def test_a_worker_starts_early_only_where_it_resolves_rays_temp_folder_as_the_head_does(example_yaml: str) -> None:
    """The mode is "early" unless the inventory gives the head and the worker different RAY_TMPDIR or TMPDIR
    (env, cluster-wide or per host) or different environment options in docker.run_options."""

    def mode(text: str) -> str:
        inv = inventory.parse(text)
        argv = shlex.split(start_script(inv, inv.hosts[1]).split(" && ")[3].removeprefix("exec "))
        return argv[6]

    assert mode(example_yaml) == "early"
    worker = "- {address: 192.0.2.12, role: worker}"
    assert worker in example_yaml
    with_worker = lambda extra: example_yaml.replace(worker, worker[:-1] + ", " + extra + "}")  # noqa: E731
    assert mode(with_worker("env: {TMPDIR: /scratch}")) == "head"
    assert mode(with_worker("env: {RAY_TMPDIR: /scratch}")) == "head"
    assert mode(with_worker("env: {OTHER: x}")) == "early"
    assert mode(with_worker("docker: {run_options: ['--env TMPDIR=/scratch']}")) == "head"
    assert mode(with_worker("docker: {run_options: ['-eTMPDIR=/scratch']}")) == "head"
    assert mode(with_worker("docker: {run_options: ['--cpus=2']}")) == "early"


@pytest.mark.parametrize(
    ("options", "quota"),
    [
        ([], None),
        (["--cpus=0.5"], 0.5),
        (["--cpus 2"], 2.0),
        (["--cpu-period=5000", "--cpu-quota=1250"], 0.25),
        (["--cpu-quota=50000"], 0.5),  # Docker's default period
        (["--cpu-quota=-1"], None),
        (["--shm-size=1g", "--cpus=abc"], None),
    ],
)
def test_the_cpu_quota_is_read_from_the_run_options(options: list[str], quota: float | None) -> None:
    assert containers.cpu_quota_of(options) == quota


def test_a_host_under_one_core_advertises_one_cpu_unless_num_cpus_is_set(example_yaml: str) -> None:
    inv = inventory.parse(example_yaml)
    worker = inv.hosts[1].model_copy(update={"num_cpus": None})
    quarter = inv.model_copy(update={"docker": inv.docker.model_copy(update={"run_options": ["--cpus=0.25"]})})
    assert "--num-cpus=1" in containers.ray_start_args(quarter, worker)
    two = inv.model_copy(update={"docker": inv.docker.model_copy(update={"run_options": ["--cpus=2"]})})
    assert not any(a.startswith("--num-cpus") for a in containers.ray_start_args(two, worker))  # Ray's own count
    pinned = worker.model_copy(update={"num_cpus": 0})
    assert "--num-cpus=0" in containers.ray_start_args(quarter, pinned)
