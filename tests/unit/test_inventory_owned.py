"""Names raycluster sets itself may not be set through `env` (issue 34, item 1), and values that would only
break later are refused when the inventory is read (item 14)."""

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.errors import ExitCode, InventoryError

BASE = """cluster: demo
image: raycluster/node:0.1.0
hosts:
  - {address: 192.0.2.11, role: head}
  - {address: 192.0.2.12, role: worker}
"""
WORKER = "{address: 192.0.2.12, role: worker}"


def _worker(extra: str) -> str:
    return BASE.replace(WORKER, WORKER[:-1] + ", " + extra + "}")


OWNED = [
    # the issue's own try: `up` reported `auth: token` while Ray ran with auth off
    ("cluster disabled", BASE + "env: {RAY_AUTH_MODE: disabled}\n", "inv.yaml:6: env.RAY_AUTH_MODE:"),
    ("host disabled", _worker("env: {RAY_AUTH_MODE: disabled}"), "inv.yaml:5: hosts[1].env.RAY_AUTH_MODE:"),
    ("token path", BASE + "env: {RAY_AUTH_TOKEN_PATH: /tmp/t}\n", "env.RAY_AUTH_TOKEN_PATH:"),
    ("token", BASE + "env: {RAY_AUTH_TOKEN: abc}\n", "env.RAY_AUTH_TOKEN:"),
    ("lower case", BASE + "env: {ray_auth_mode: disabled}\n", "env.ray_auth_mode:"),
    ("auth none too", BASE + "ray: {auth: none}\nenv: {RAY_AUTH_MODE: token}\n", "env.RAY_AUTH_MODE:"),
]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in OWNED], ids=[c[0] for c in OWNED])
def test_env_may_not_set_the_names_raycluster_owns(text: str, expected: str) -> None:
    with pytest.raises(InventoryError) as info:
        inventory.parse(text, "inv.yaml")
    error = info.value
    assert expected in error.message and error.message.startswith("inv.yaml:")
    assert "raycluster sets" in error.message
    assert "ray.auth" in error.hint and "remove" in error.hint
    assert "\n" not in error.one_line()
    assert error.exit_code == ExitCode.USAGE


def test_other_ray_names_stay_allowed() -> None:
    inv = inventory.parse(BASE + "env: {RAY_TMPDIR: /data/ray, RAY_AUTHOR: me, NCCL_SOCKET_IFNAME: eth1}\n")
    assert inv.env_for(inv.hosts[1])["RAY_TMPDIR"] == "/data/ray"


BOUNDS = [
    ("env NUL", BASE + 'env: {A: "x\\0y"}\n', "inv.yaml:6: env.A:"),
    ("host env NUL", _worker('env: {A: "x\\0y"}'), "hosts[1].env.A:"),
    ("known_hosts_file NUL", BASE + 'ssh: {known_hosts_file: "/tmp/k\\0x"}\n', "ssh.known_hosts_file:"),
    ("key NUL", BASE + 'ssh: {key: "/tmp/k\\0x"}\n', "ssh.key:"),
    ("config_file NUL", BASE + 'ssh: {config_file: "/tmp/c\\0x"}\n', "ssh.config_file:"),
    ("tiny timeout", BASE + "ssh: {connect_timeout_s: 1e-300}\n", "ssh.connect_timeout_s:"),
    ("tiny stall", BASE + "ssh: {stall_timeout_s: 1e-9}\n", "ssh.stall_timeout_s:"),
    ("tiny keepalive", BASE + "ssh: {keepalive_interval_s: 1e-9}\n", "ssh.keepalive_interval_s:"),
    ("huge num_cpus", _worker("num_cpus: 100000000000000000000000"), "hosts[1].num_cpus:"),
    ("huge num_gpus", _worker("num_gpus: 100000000000000000000000"), "hosts[1].num_gpus:"),
]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in BOUNDS], ids=[c[0] for c in BOUNDS])
def test_values_that_would_only_break_later_are_refused_at_load(text: str, expected: str) -> None:
    with pytest.raises(InventoryError) as info:
        inventory.parse(text, "inv.yaml")
    assert expected in info.value.message and info.value.message.startswith("inv.yaml")
    assert "\n" not in info.value.one_line() and info.value.hint
    assert info.value.exit_code == ExitCode.USAGE


def test_ordinary_values_stay_accepted() -> None:
    inv = inventory.parse(
        _worker("num_cpus: 256, num_gpus: 8, env: {A: 'tab\\tand newline\\n'}")
        + "ssh: {connect_timeout_s: 0.5, stall_timeout_s: 5}\n"
    )
    assert inv.hosts[1].num_cpus == 256 and inv.ssh.connect_timeout_s == 0.5
