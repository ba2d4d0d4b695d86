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
