"""`up` with a host added to the inventory: the running nodes' plans stay "keep" (their container's configuration,
env file and token digest do not depend on the other hosts), and only the new host is started."""

from __future__ import annotations

from raycluster_cli.config import inventory
from raycluster_cli.host.containers import (
    LABEL_CLUSTER,
    LABEL_CONFIG,
    LABEL_ROLE,
    Container,
    config_hash,
    env_file_content,
    run_argv,
)
from raycluster_cli.host.node import ContainerView, files_digest, node_env, plan_node

from .conftest import EXAMPLE

IMAGE = "sha256:" + "a" * 64
TOKEN = b"t" * 32
IP_ADDR = "2: eth0    inet 192.0.2.{n}/24 brd 192.0.2.255 scope global eth0"
ADDED = "  - {address: 192.0.2.14, role: worker}\n"


def _running(inv: inventory.Inventory, host: inventory.HostConfig, digest: str) -> ContainerView:
    """The container `up` started on ``host`` from ``inv``, running."""
    labels = {LABEL_CLUSTER: inv.cluster, LABEL_ROLE: host.role, LABEL_CONFIG: config_hash(run_argv(inv, host))}
    return ContainerView(Container("id", "name", "running", inv.image, labels), IMAGE, digest)


def _digest(inv: inventory.Inventory, host: inventory.HostConfig) -> str:
    last = str(host.address).rsplit(".", 1)[1]
    return files_digest(env_file_content(node_env(inv, host, IP_ADDR.format(n=last))), TOKEN)


def test_a_host_added_to_the_inventory_keeps_every_running_node_and_starts_only_itself() -> None:
    before = inventory.parse(EXAMPLE)
    after = inventory.parse(EXAMPLE + ADDED)
    assert len(after.hosts) == len(before.hosts) + 1
    for old, new in zip(before.hosts, after.hosts, strict=False):
        view = _running(before, old, _digest(before, old))
        assert plan_node(after, new, view, IMAGE, _digest(after, new)).action == "keep", new.address
    added = after.hosts[-1]
    assert plan_node(after, added, ContainerView(None), IMAGE, _digest(after, added)).action == "start"


def test_a_changed_host_is_replaced_so_the_keep_above_is_not_vacuous() -> None:
    """The same check sees a change when there is one: a host's own run options."""
    before = inventory.parse(EXAMPLE)
    after = inventory.parse(EXAMPLE.replace('"--cpus=0.5"', '"--cpus=0.75"'))
    host = before.hosts[2]
    view = _running(before, host, _digest(before, host))
    plan = plan_node(after, after.hosts[2], view, IMAGE, _digest(after, after.hosts[2]))
    assert plan.action == "replace" and "configuration changed" in plan.reason
