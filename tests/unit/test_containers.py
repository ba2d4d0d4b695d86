import shlex
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from raycluster_cli import inventory
from raycluster_cli.containers import (
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
        '#!/bin/sh\necho "A=$A $1 $3 $4 $5" >"$D/calls"; shift 5; echo "$*" >>"$D/calls"\n'
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
    assert calls == [f"A=from-env-file -c 192.0.2.11 6379 {GCS_WAIT_S}", "ray start --block"]
    head_script = start_script(inv, inv.head_host)
    assert "python3" not in head_script and head_script.endswith('exec "$@"')


def _wait_code(example_yaml: str) -> str:
    inv = inventory.parse(example_yaml)
    argv = shlex.split(start_script(inv, inv.hosts[1]).split(" && ")[3].removeprefix("exec "))
    assert argv[:2] == ["python3", "-c"]
    return argv[2]


class _FakeRay:
    """The parts of Ray the wait uses, as modules in sys.modules: a GCS client that knows the head's node
    from its `known_after`-th answer on, and `ray start`'s entry point, which records its argv."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, known_after: int, with_client: bool = True) -> None:
        self.asked = 0
        self.address = ""
        self.started: list[str] = []
        self.events: list[str] = []  # the import of `ray start`'s entry point, each connect: in order
        fake = self

        class GcsClient:
            def __init__(self, address: str) -> None:
                fake.address = address

            def get_all_node_info(self, timeout: float, node_selectors: list[object]) -> dict[str, object]:
                fake.asked += 1
                return {"head": object()} if fake.asked >= known_after else {}

        class NodeSelector:
            def __init__(self, is_head_node: bool) -> None:
                assert is_head_node

        def main() -> int:
            fake.started = list(sys.argv)
            return 0

        def entry_point(name: str) -> object:  # `from ray.scripts.scripts import main` says when it ran
            if name != "main":
                raise AttributeError(name)
            fake.events.append("import ray start")
            return main

        request = type("GetAllNodeInfoRequest", (), {"NodeSelector": NodeSelector})
        modules: dict[str, dict[str, object]] = {
            "ray": {},
            "ray._raylet": {"GcsClient": GcsClient} if with_client else {},
            "ray.core": {},
            "ray.core.generated": {},
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
    monkeypatch.setattr(sys, "argv", ["-c", "192.0.2.11", "6379", "600", "ray", "start", "--block"])
    ray = _FakeRay(monkeypatch, known_after=3)
    with pytest.raises(SystemExit) as ended:
        exec(compile(code, "<wait>", "exec"), {})
    assert ended.value.code == 0
    assert tries == [("192.0.2.11", 6379)] * 4
    # `ray start`'s modules are imported before the wait, while the head starts, not after its node is known.
    assert ray.events == ["import ray start"] + ["connect"] * 4
    assert capsys.readouterr().out == "raycluster: waiting for the GCS of the head at 192.0.2.11:6379\n"
    assert (ray.address, ray.asked, ray.started) == ("192.0.2.11:6379", 3, ["ray", "start", "--block"])

    # A Ray without that GCS client (another version): `ray start` at once, which looks for the head itself.
    monkeypatch.setattr(sys, "argv", ["-c", "192.0.2.11", "6379", "600", "ray", "start", "--block"])
    other = _FakeRay(monkeypatch, known_after=1, with_client=False)
    with pytest.raises(SystemExit):
        exec(compile(code, "<wait>", "exec"), {})
    assert (other.asked, other.started) == (0, ["ray", "start", "--block"])

    monkeypatch.setattr(socket, "create_connection", lambda a, t: (_ for _ in ()).throw(OSError("unreachable")))
    monkeypatch.setattr(sys, "argv", ["-c", "192.0.2.11", "6379", "1", "ray", "start"])
    with pytest.raises(SystemExit) as ended:
        exec(compile(code, "<wait>", "exec"), {})
    assert str(ended.value) == "raycluster: the GCS of the head at 192.0.2.11:6379 did not answer within 1s"
