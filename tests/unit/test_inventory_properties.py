"""Property-based tests of the inventory loader and model (hypothesis).

Whatever bytes, text or YAML arrives, the only exception is InventoryError, as one line starting with the
file name; every valid inventory that can be generated loads with exactly the values written, and
survives a dump → load round trip.
"""

from __future__ import annotations

import shlex
from ipaddress import IPv4Address
from typing import Any

import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from raycluster_cli.config import inventory
from raycluster_cli.config.references import hostname_problem, image_problem, login_problem
from raycluster_cli.errors import InventoryError

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FIELDS = ["cluster", "image", "hosts", "address", "role", "head", "worker", "ssh", "user", "docker", "run_options",
          "env", "resources", "num_cpus", "num_gpus", "hostname", "ray", "port", "shm_size", "<<"]  # fmt: skip


def _only_inventory_errors(call: Any, *args: Any) -> None:
    try:
        result = call(*args, "inv.yaml")
    except InventoryError as error:
        line = error.one_line()
        assert line.startswith("inv.yaml"), line
        assert "\n" not in line and "\r" not in line, line
        assert error.hint
    else:
        assert isinstance(result, inventory.Inventory)


@SETTINGS
@given(st.binary(max_size=3000))
def test_any_bytes_give_an_inventory_or_an_inventory_error(data: bytes) -> None:
    _only_inventory_errors(inventory.parse_bytes, data)


@SETTINGS
@given(st.text(max_size=2000))
def test_any_text_gives_an_inventory_or_an_inventory_error(text: str) -> None:
    _only_inventory_errors(inventory.parse, text)


yaml_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30) | st.sampled_from(FIELDS)
yaml_values = st.recursive(
    yaml_scalars,
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=40,
)


@SETTINGS
@given(st.dictionaries(st.sampled_from(FIELDS), yaml_values, max_size=8))
def test_any_yaml_mapping_gives_an_inventory_or_an_inventory_error(data: dict[str, Any]) -> None:
    _only_inventory_errors(inventory.parse, yaml.safe_dump(data))


# Valid inventories ------------------------------------------------------------------------------------

# Built from parts rather than from the full patterns: generating from the whole grammar is slow.
_ALNUM = st.text("abz019", min_size=1, max_size=4)
_COMPONENT = st.builds(
    lambda first, rest: first + "".join(sep + part for sep, part in rest),
    _ALNUM,
    st.lists(st.tuples(st.sampled_from([".", "_", "__", "-", "--"]), _ALNUM), max_size=2),
)
images = st.builds(
    lambda domain, path, tag, digest: domain + "/".join(path) + tag + digest,
    st.sampled_from(["", "localhost:5000/", "Registry.example.com/", "[2001:db8::1]:5000/"]),
    st.lists(_COMPONENT, min_size=1, max_size=3),
    st.just("") | st.text("aZ09_.-", max_size=8).map(lambda t: ":x" + t),
    st.just("") | st.text("0123456789abcdef", min_size=32, max_size=64).map(lambda h: "@sha256:" + h),
)
_LABEL = st.builds(
    lambda a, b: a + (f"-{b}" if b else ""), st.text("aZ09", min_size=1, max_size=6), st.text("aZ09", max_size=3)
)
hostnames = st.lists(_LABEL, min_size=1, max_size=3).map(".".join)
names = st.builds(lambda a, b: a + b, st.text("a09", min_size=1, max_size=1), st.text("az09_.-", max_size=12))
logins = st.builds(lambda a, b: a + b, st.text("aZ0_", min_size=1, max_size=1), st.text("aZ09_.@-", max_size=10))
env_names = st.builds(lambda a, b: a + b, st.text("aZ_", min_size=1, max_size=1), st.text("aZ09_", max_size=8))
env_values = st.text(st.characters(exclude_characters="\x00"), max_size=20)  # a NUL is refused (issue 34, item 14)
amounts = st.floats(min_value=0, max_value=1e9, allow_nan=False)
addresses = st.integers(int(IPv4Address("10.0.0.1")), int(IPv4Address("10.255.255.254"))).map(
    lambda i: str(IPv4Address(i))
)
run_options = st.lists(st.text(max_size=12), max_size=3).map(shlex.join)


@st.composite
def hosts(draw: st.DrawFn, address: str, role: str) -> dict[str, Any]:
    host: dict[str, Any] = {"address": address, "role": role}
    if draw(st.booleans()):
        host["hostname"] = draw(hostnames)
    if draw(st.booleans()):
        host["num_cpus"] = draw(st.integers(0, 1024))
    if draw(st.booleans()):
        host["num_gpus"] = draw(st.integers(0, 64))
    host["resources"] = draw(st.dictionaries(st.text("az09_.:/-", min_size=1, max_size=8), amounts, max_size=2))
    host["env"] = draw(st.dictionaries(env_names, env_values, max_size=3))
    host["docker"] = {"run_options": draw(st.lists(run_options, max_size=3))}
    if draw(st.booleans()):
        host["ssh"] = {"user": draw(logins), "port": draw(st.integers(1, 65535))}
    return host


@st.composite
def valid_inventories(draw: st.DrawFn) -> dict[str, Any]:
    where = draw(st.lists(addresses, min_size=1, max_size=4, unique=True))
    data: dict[str, Any] = {
        "cluster": draw(names),
        "image": draw(images),
        "env": draw(st.dictionaries(env_names, env_values, max_size=3)),
        "ssh": {"user": draw(logins), "connect_timeout_s": draw(st.floats(0.1, 600))},
        "docker": {"shm_size": f"{draw(st.integers(1, 9999))}{draw(st.sampled_from('bkmg'))}"},
        "hosts": [draw(hosts(a, "head" if i == 0 else "worker")) for i, a in enumerate(where)],
    }
    if draw(st.booleans()):
        data["head"] = {"address": where[0]}
    return data


@SETTINGS
@given(images, hostnames, logins)
def test_the_generators_make_what_the_grammar_accepts(image: str, hostname: str, login: str) -> None:
    assert image_problem(image) is None, image
    assert hostname_problem(hostname) is None, hostname
    assert login_problem(login) is None, login


@SETTINGS
@given(valid_inventories())
def test_generated_inventories_load_with_their_values(data: dict[str, Any]) -> None:
    inv = inventory.parse(yaml.safe_dump(data))
    assert inv.cluster == data["cluster"] and inv.image == data["image"]
    assert inv.env == data["env"]
    assert inv.head_address == data["hosts"][0]["address"]
    for host, given_host in zip(inv.hosts, data["hosts"], strict=True):
        assert str(host.address) == given_host["address"]
        assert host.hostname == given_host.get("hostname")
        assert host.num_cpus == given_host.get("num_cpus")
        assert host.resources == given_host["resources"] and host.env == given_host["env"]
        assert host.docker.run_options == given_host["docker"]["run_options"]
        assert inv.ssh_for(host).user == given_host.get("ssh", data["ssh"])["user"]


@SETTINGS
@given(valid_inventories())
def test_dump_and_load_round_trip(data: dict[str, Any]) -> None:
    inv = inventory.parse(yaml.safe_dump(data))
    again = inventory.parse(yaml.safe_dump(inv.model_dump(mode="json")))
    assert again == inv


@SETTINGS
@given(valid_inventories(), st.data())
def test_one_field_replaced_by_any_value(data: dict[str, Any], draw: st.DataObject) -> None:
    """Any value in any place: an inventory or one InventoryError naming the place."""
    target: Any = data
    path: list[Any] = []
    while isinstance(target, dict | list) and target and draw.draw(st.booleans()):
        key = draw.draw(st.sampled_from(sorted(target) if isinstance(target, dict) else range(len(target))))
        path.append(key)
        if not isinstance(target[key], dict | list) or not target[key]:
            break
        target = target[key]
    assume(path)
    parent: Any = data
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = draw.draw(yaml_values)
    _only_inventory_errors(inventory.parse, yaml.safe_dump(data))


@SETTINGS
@given(valid_inventories(), st.data())
def test_a_repeated_key_is_refused_at_any_level(data: dict[str, Any], draw: st.DataObject) -> None:
    text = yaml.safe_dump(data, default_flow_style=False, sort_keys=True)
    lines = text.splitlines()
    keyed = [
        i
        for i, line in enumerate(lines)
        if ":" in line and not line.lstrip().startswith("- ") and not line.rstrip().endswith(":")
    ]
    keyed = [i for i in keyed if lines[i].split(":")[0].strip().isidentifier()]

    def indent(line: str) -> int:
        return len(line) - len(line.lstrip())

    # Only a key whose value ends on its own line: a long scalar that the dumper folded onto more indented
    # lines would be cut in two by the copy (invalid YAML, not a repeated key).
    keyed = [i for i in keyed if i + 1 == len(lines) or indent(lines[i + 1]) <= indent(lines[i])]
    # Nor a quoted scalar that goes on past its line (a value with a newline: `key: '` then a blank line).
    keyed = [i for i in keyed if _whole_mapping(lines[i].strip())]
    assume(keyed)
    index = draw.draw(st.sampled_from(keyed))
    lines.insert(index + 1, lines[index])  # the same key again, in the same mapping, on the next line
    try:
        inventory.parse("\n".join(lines) + "\n", "inv.yaml")
    except InventoryError as error:
        assert f"inv.yaml:{index + 2}:" in error.message and "duplicate key" in error.message, error.message
    else:
        raise AssertionError("a repeated key was accepted")


def _whole_mapping(line: str) -> bool:
    try:
        return isinstance(yaml.safe_load(line), dict)
    except yaml.YAMLError:
        return False


@SETTINGS
@given(valid_inventories(), st.data())
def test_corrupted_bytes_give_an_inventory_or_an_inventory_error(data: dict[str, Any], draw: st.DataObject) -> None:
    raw = bytearray(yaml.safe_dump(data).encode())
    for _ in range(draw.draw(st.integers(1, 4))):
        raw[draw.draw(st.integers(0, len(raw) - 1))] = draw.draw(st.integers(0, 255))
    _only_inventory_errors(inventory.parse_bytes, bytes(raw))
