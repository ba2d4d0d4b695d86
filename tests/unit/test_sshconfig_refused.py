"""ssh_config options raycluster does not follow are refused with a message, not silently ignored (the host
was dialled directly), and a bad Port is one line (issue 34, item 13). The config files are as users write
them."""

from __future__ import annotations

from pathlib import Path

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.errors import InventoryError
from raycluster_cli.transport.sshconfig import Hop, load_config, resolve

BASE = """
cluster: demo
image: raycluster/node:0.1.0
hosts:
  - {address: 192.0.2.11, role: head}
  - {address: 192.0.2.12}
"""
INV = inventory.parse(BASE)

REFUSED = [
    ("proxy command", "Host 192.0.2.*\n  ProxyCommand ssh -W %h:%p bastion\n", "ProxyCommand"),
    ("host key alias", "Host 192.0.2.12\n  HostKeyAlias node2\n", "HostKeyAlias"),
    ("global known hosts", "Host *\n  GlobalKnownHostsFile /etc/ssh/fleet_known_hosts\n", "GlobalKnownHostsFile"),
    ("port word", "Host 192.0.2.12\n  Port abc\n", "Port 'abc'"),
    ("jump port word", "Host bastion\n  Port ssh\nHost 192.0.2.12\n  ProxyJump bastion\n", "Port 'ssh'"),
    (
        "jump proxy command",
        "Host bastion\n  ProxyCommand nc %h %p\nHost 192.0.2.12\n  ProxyJump bastion\n",
        "ProxyCommand",
    ),
]


@pytest.mark.parametrize(("text", "named"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_options_raycluster_does_not_follow_are_refused_naming_them(tmp_path: Path, text: str, named: str) -> None:
    path = tmp_path / "config"
    path.write_text(text)
    with pytest.raises(InventoryError) as info:
        resolve(INV, INV.hosts[1], load_config(str(path)))
    error = info.value
    assert named in error.message and str(path) in error.message and "192.0.2.12" in error.message
    assert "\n" not in error.one_line() and error.hint


def test_what_raycluster_follows_or_what_changes_nothing_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "config"
    path.write_text(
        "Host 192.0.2.*\n  ProxyCommand none\n  GlobalKnownHostsFile /etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2\n"
        "  UserKnownHostsFile ~/.ssh/known_hosts\n  Port 2022\n"
    )
    assert resolve(INV, INV.hosts[1], load_config(str(path))).target == Hop("192.0.2.12", 2022, "root", None)


def test_the_inventorys_proxy_jump_wins_over_a_configs_proxy_command(tmp_path: Path) -> None:
    path = tmp_path / "config"
    path.write_text("Host 192.0.2.*\n  ProxyCommand ssh -W %h:%p old-bastion\n")
    inv = inventory.parse(BASE + "ssh: {proxy_jump: admin@198.51.100.7}\n")
    route = resolve(inv, inv.hosts[1], load_config(str(path)))
    assert route.jumps == (Hop("198.51.100.7", 22, "admin", None),)
