import shlex

from raycluster_cli import inventory
from raycluster_cli.containers import (
    ENV_IN_CONTAINER,
    LABEL_CLUSTER,
    LABEL_CONFIG,
    TOKEN_IN_CONTAINER,
    config_hash,
    container_name,
    docker_run_command,
    env_file_content,
    parse_ps,
    run_argv,
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
