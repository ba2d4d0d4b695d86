from pathlib import Path

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.errors import ExitCode, InventoryError


def test_example_shape_parses(example_yaml: str) -> None:
    inv = inventory.parse(example_yaml)
    assert inv.cluster == "demo"
    assert inv.head_address == "192.0.2.11"
    assert [str(w.address) for w in inv.workers] == ["192.0.2.12", "192.0.2.13"]
    assert inv.docker_for(inv.hosts[2]).run_options == ["--cpus=0.5"]
    assert inv.docker_for(inv.hosts[2]).shm_size == "2g"
    assert inv.ssh_for(inv.hosts[0]).known_hosts == "strict"
    assert inv.ray.auth == "token"


def test_shipped_example_inventory_is_valid() -> None:
    path = Path(__file__).parents[2] / "inventory.example.yaml"
    inv = inventory.load(path).inventory
    assert inv.head_host.role == "head"


def test_head_address_defaults_to_head_host() -> None:
    inv = inventory.parse("cluster: c\nimage: i\nhosts:\n  - {address: 192.0.2.5, role: head}\n")
    assert inv.head_address == "192.0.2.5"
    assert inv.node_ip(inv.head_host) == "192.0.2.5"


def test_per_host_ssh_override(example_yaml: str) -> None:
    text = example_yaml.replace("{address: 192.0.2.12, role: worker}", "{address: 192.0.2.12, ssh: {port: 2222}}")
    inv = inventory.parse(text)
    assert inv.ssh_for(inv.hosts[1]).port == 2222
    assert inv.ssh_for(inv.hosts[1]).user == "root"


@pytest.mark.parametrize(
    ("mutation", "expected"),
    [
        (("192.0.2.13, role", "192.0.2.300, role"), ":9: hosts[2].address"),
        (("role: worker}", "role: worker, colour: red}"), "hosts[1].colour"),
        (("role: head}", "role: worker}"), "exactly one host needs role: head"),
        (("known_hosts: strict", "known_hosts: yes"), "ssh.known_hosts"),
        (("cluster: demo", "cluster: Demo Cluster"), ":2: cluster"),
        (("image: raycluster/node:0.1.0\n", ""), "image: Field required"),
        (("{address: 192.0.2.13,", "{address: 192.0.2.12,"), "listed twice"),
    ],
)
def test_errors_name_the_field_and_line(example_yaml: str, mutation: tuple[str, str], expected: str) -> None:
    text = example_yaml.replace(*mutation)
    assert text != example_yaml
    with pytest.raises(InventoryError) as info:
        inventory.parse(text, "inv.yaml")
    assert expected in info.value.message
    assert info.value.message.startswith("inv.yaml")
    assert info.value.hint
    assert info.value.exit_code == ExitCode.USAGE


def test_yaml_syntax_error_names_line() -> None:
    with pytest.raises(InventoryError) as info:
        inventory.parse("cluster: demo\nhosts: [\n", "bad.yaml")
    assert info.value.message.startswith("bad.yaml:")
    assert "invalid YAML" in info.value.message


def test_not_a_mapping() -> None:
    with pytest.raises(InventoryError, match="must be a mapping"):
        inventory.parse("- a\n- b\n")


def test_path_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(inventory.INVENTORY_ENV, raising=False)
    assert inventory.resolve_path(None) == Path("inventory.yaml")
    monkeypatch.setenv(inventory.INVENTORY_ENV, str(tmp_path / "x.yaml"))
    assert inventory.resolve_path(None) == tmp_path / "x.yaml"
    assert inventory.resolve_path("given.yaml") == Path("given.yaml")
    with pytest.raises(InventoryError, match="not found"):
        inventory.load(None)


def test_worker_port_range_defaults_and_checks() -> None:
    base = "cluster: c\nimage: i\nhosts:\n  - {address: 192.0.2.11, role: head}\n"
    ray = inventory.parse(base).ray
    assert (ray.min_worker_port, ray.max_worker_port) == (10002, 19999)
    with pytest.raises(InventoryError, match="min_worker_port 20000 is above max_worker_port 19999"):
        inventory.parse(base + "ray: {min_worker_port: 20000}\n")
    with pytest.raises(InventoryError, match="port 12000 lies inside the worker port range"):
        inventory.parse(base + "ray: {dashboard_port: 12000}\n")
