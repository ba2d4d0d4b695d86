"""Reaching hosts as OpenSSH does: ~/.ssh/config entries, the inventory's proxy_jump, precedence."""

from __future__ import annotations

from pathlib import Path

import paramiko
import pytest

from raycluster_cli.config import inventory
from raycluster_cli.errors import InventoryError
from raycluster_cli.transport.sshconfig import Hop, JumpSpec, load_config, parse_jumps, resolve

BASE = """
cluster: demo
image: raycluster/node:0.1.0
hosts:
  - {address: 192.0.2.11, role: head}
  - {address: 192.0.2.12}
"""


def _config(tmp_path: Path, text: str) -> paramiko.SSHConfig:
    (tmp_path / "jumpkey").write_text("key")
    path = tmp_path / "config"
    path.write_text(text.replace("JUMPKEY", str(tmp_path / "jumpkey")))
    return load_config(str(path))


def test_jump_specs() -> None:
    assert parse_jumps("admin@bastion:2222, j2") == [JumpSpec("admin", "bastion", 2222), JumpSpec(None, "j2", None)]
    assert parse_jumps("none") == []
    with pytest.raises(InventoryError, match="not \\[user@\\]host\\[:port\\]"):
        parse_jumps("a@b:99999")


def test_inventory_validates_proxy_jump_where_it_is_written() -> None:
    with pytest.raises(InventoryError, match=r"hosts\[1\]\.ssh\.proxy_jump"):
        inventory.parse(BASE.replace("{address: 192.0.2.12}", "{address: 192.0.2.12, ssh: {proxy_jump: 'a b'}}"))


def test_ssh_config_fills_in_what_the_inventory_does_not_set(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        "Host bastion\n  HostName 198.51.100.7\n  User jumper\n  Port 2200\n  IdentityFile JUMPKEY\n"
        "Host 192.0.2.*\n  User admin\n  Port 2022\n  ProxyJump bastion\n",
    )
    inv = inventory.parse(BASE + "ssh: {key: /k/id}\n")
    route = resolve(inv, inv.hosts[1], config)
    assert route.target == Hop("192.0.2.12", 2022, "admin", "/k/id")  # the inventory's explicit key wins
    assert route.jumps == (Hop("198.51.100.7", 2200, "jumper", str(tmp_path / "jumpkey")),)


def test_the_inventory_wins_over_the_config_and_a_host_may_opt_out_of_the_jump(tmp_path: Path) -> None:
    config = _config(tmp_path, "Host *\n  User admin\n  ProxyJump bastion\n")
    text = BASE.replace("{address: 192.0.2.12}", "{address: 192.0.2.12, ssh: {proxy_jump: none, port: 2201}}")
    inv = inventory.parse(text + "ssh: {user: ops, proxy_jump: 'root@10.9.9.9:22'}\n")
    head, worker = (resolve(inv, h, config) for h in inv.hosts)
    assert head.target.user == "ops" and head.jumps == (Hop("10.9.9.9", 22, "root", inv.ssh.key),)
    assert worker.jumps == () and worker.target.port == 2201


def test_no_config_file_means_the_inventory_alone(tmp_path: Path) -> None:
    inv = inventory.parse(BASE)
    route = resolve(inv, inv.hosts[0], load_config(str(tmp_path / "absent")))
    assert route.target == Hop("192.0.2.11", 22, "root", inv.ssh.key) and route.jumps == ()
    assert resolve(inv, inv.hosts[0], load_config(None)) == route


def test_a_host_alias_maps_to_its_hostname(tmp_path: Path) -> None:
    config = _config(tmp_path, "Host 192.0.2.11\n  HostName 10.1.1.11\n")
    inv = inventory.parse(BASE)
    assert resolve(inv, inv.hosts[0], config).target.host == "10.1.1.11"


class _FakeParamiko:
    def __init__(self, name: str, fail: bool = False) -> None:
        self.name, self.fail = name, fail
        self.opened: list[tuple[str, int]] = []

    def open_channel(self, kind: str, dest: tuple[str, int], origin: tuple[str, int], timeout: float) -> str:
        if self.fail:
            raise paramiko.ChannelException(2, "Connect failed")
        self.opened.append(dest)
        return f"channel via {self.name} to {dest[0]}:{dest[1]}"


class _FakeSSH:
    def __init__(self, hop: Hop, sock: object, fail: bool = False) -> None:
        self.hop, self.sock, self.closed = hop, sock, False
        self.wire = _FakeParamiko(hop.host, fail)

    def paramiko_transport(self) -> _FakeParamiko:
        return self.wire

    def close(self) -> None:
        self.closed = True


def test_one_connection_per_jump_chain_shared_by_its_targets() -> None:
    from raycluster_cli.errors import TransportError
    from raycluster_cli.transport.jumps import JumpHosts
    from raycluster_cli.transport.sshconfig import Route

    made: list[_FakeSSH] = []

    def make(hop: Hop, sock: object) -> _FakeSSH:
        made.append(_FakeSSH(hop, sock, fail=hop.host == "dead"))
        return made[-1]

    jumps = JumpHosts(make)
    outer, inner = Hop("b1", 22, "u", None), Hop("b2", 22, "u", None)
    assert jumps.sock_for(Route(Hop("t0", 22, "r", None))) is None
    socks = [jumps.sock_for(Route(Hop(f"t{i}", 22, "r", None), (outer, inner))) for i in (1, 2)]
    assert [s(5.0) for s in socks if s] == ["channel via b2 to t1:22", "channel via b2 to t2:22"]
    assert [m.hop.host for m in made] == ["b1", "b2"]  # each jump host once, the outer one first
    assert made[0].sock is None and made[1].sock is not None
    assert made[1].sock(5.0) == "channel via b1 to b2:22"  # type: ignore[operator]
    broken = jumps.sock_for(Route(Hop("t3", 22, "r", None), (Hop("dead", 22, "u", None),)))
    with pytest.raises(TransportError, match="jump host u@dead could not connect to t3:22"):
        broken(5.0)  # type: ignore[misc]
    jumps.close()
    assert all(m.closed for m in made)
