"""Every bad inventory of issue 10 is exit 2 with one line naming the field and its line (examples)."""

from pathlib import Path

import pytest

from raycluster_cli.config import inventory, strict_yaml
from raycluster_cli.config.references import hostname_problem, image_problem
from raycluster_cli.errors import ExitCode, InventoryError

BASE = """cluster: demo
image: raycluster/node:0.1.0
hosts:
  - {address: 192.0.2.11, role: head}
  - {address: 192.0.2.12, role: worker}
"""
WORKER = "{address: 192.0.2.12, role: worker}"


def _worker(extra: str) -> bytes:
    return BASE.replace(WORKER, WORKER[:-1] + ", " + extra + "}").encode()


CASES = [
    ("not UTF-8", BASE.encode() + b"# caf\xe9\n", "inv.yaml:6: not UTF-8 text (byte 0xe9 at column 6)"),
    ("deep nesting", (BASE + "env: " + "[" * 5000 + "]" * 5000 + "\n").encode(), "inv.yaml:6: invalid YAML (nested"),
    ("too large", BASE.encode() + b"#" * strict_yaml.MAX_BYTES, f"larger than {strict_yaml.MAX_BYTES // 1024} KiB"),
    ("duplicate top key", (BASE + "cluster: other\n").encode(), "inv.yaml:6: cluster: duplicate key (first at line 1)"),
    ("duplicate hosts", (BASE + "hosts: []\n").encode(), "inv.yaml:6: hosts: duplicate key (first at line 3)"),
    ("duplicate in host", _worker("role: head"), "inv.yaml:5: hosts[1].role: duplicate key"),
    ("duplicate deep", (BASE + "ray:\n  port: 1\n  port: 2\n").encode(), "inv.yaml:8: ray.port: duplicate key"),
    ("empty image", BASE.replace("raycluster/node:0.1.0", "''").encode(), "inv.yaml:2: image: '' is not a Docker"),
    ("image option", BASE.replace("raycluster/node:0.1.0", "--privileged").encode(), "image: '--privileged' is not"),
    ("image upper", BASE.replace("raycluster/node:0.1.0", "Node:1").encode(), "inv.yaml:2: image: 'Node:1' is not"),
    ("empty user", (BASE + "ssh: {user: ''}\n").encode(), "inv.yaml:6: ssh.user: '' is not a login name"),
    ("option user", (BASE + "ssh: {user: -oProxyCommand=x}\n").encode(), "ssh.user: '-oProxyCommand=x' is not"),
    ("host user", _worker("ssh: {user: ''}"), "inv.yaml:5: hosts[1].ssh.user"),
    ("hostname space", _worker("hostname: 'a b'"), "inv.yaml:5: hosts[1].hostname: 'a b' is not a hostname"),
    ("hostname dash", _worker("hostname: -x"), "hosts[1].hostname: '-x' is not a hostname"),
    ("hostname long", _worker("hostname: " + "a" * 65), "hosts[1].hostname: " + "'" + "a" * 65),
    ("run_options quote", _worker("docker: {run_options: ['--label \"x']}"), "hosts[1].docker.run_options[0]:"),
    ("cluster newline", BASE.replace("cluster: demo", 'cluster: "demo\\n"').encode(), "inv.yaml:1: cluster: 'demo\\n'"),
    ("num_cpus inf", _worker("num_cpus: .inf"), "inv.yaml:5: hosts[1].num_cpus: Input should be a finite number"),
    ("num_cpus nan", _worker("num_cpus: .nan"), "hosts[1].num_cpus: Input should be a finite number"),
    # `ray start --num-cpus` refuses a fraction: caught here, not in the node's container after the image went out
    ("num_cpus half", _worker("num_cpus: 0.5"), "hosts[1].num_cpus: Input should be a valid integer, got a number"),
    ("resource inf", _worker("resources: {a: .inf}"), "hosts[1].resources.a: Input should be a finite number"),
    ("timeout inf", (BASE + "ssh: {connect_timeout_s: .inf}\n").encode(), "ssh.connect_timeout_s: Input should be"),
    ("unspecified", BASE.replace("192.0.2.12", "0.0.0.0").encode(), "inv.yaml:5: hosts[1].address: 0.0.0.0 is not"),
    ("multicast", BASE.replace("192.0.2.12", "239.1.1.1").encode(), "hosts[1].address: 239.1.1.1 is not"),
    ("broadcast", BASE.replace("192.0.2.12", "255.255.255.255").encode(), "hosts[1].address: 255.255.255.255 is"),
    ("class E", BASE.replace("192.0.2.12", "240.0.0.1").encode(), "hosts[1].address: 240.0.0.1 is not"),
    ("head unspecified", (BASE + "head: {address: 0.0.0.0}\n").encode(), "inv.yaml:6: head.address: 0.0.0.0"),
    (
        "loopback multi",
        BASE.replace("192.0.2.12", "127.0.0.2").encode(),
        "hosts[1].address: 127.0.0.2 is a loopback address in a cluster with other machines (192.0.2.11)",
    ),
    ("head loopback", (BASE + "head: {address: 127.0.0.1}\n").encode(), "inv.yaml:6: head.address: 127.0.0.1 is a"),
    ("head is worker", (BASE + "head: {address: 192.0.2.12}\n").encode(), "head.address: 192.0.2.12 is the address"),
    ("duplicate address", BASE.replace("192.0.2.12", "192.0.2.11").encode(), "inv.yaml:5: hosts[1].address: 192.0"),
    ("bad date", BASE.replace("raycluster/node:0.1.0", "2001-02-30").encode(), "inv.yaml:2: invalid YAML (cannot"),
    ("huge int", (BASE + "ssh: {port: " + "9" * 5000 + "}\n").encode(), "inv.yaml:6: invalid YAML (cannot read"),
    ("NUL", BASE.encode() + b"x: \x00\n", "inv.yaml:6: invalid YAML (character #x0000"),
    ("python tag", (BASE + "x: !!python/object:os.system x\n").encode(), "inv.yaml:6: invalid YAML (could not"),
    ("empty key", (BASE + "ssh: {key: ''}\n").encode(), "inv.yaml:6: ssh.key"),
]


@pytest.mark.parametrize(("data", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_inventory_is_one_line_naming_the_field(data: bytes, expected: str) -> None:
    with pytest.raises(InventoryError) as info:
        inventory.parse_bytes(data, "inv.yaml")
    error = info.value
    assert expected in error.message
    assert error.message.startswith("inv.yaml")
    assert "\n" not in error.one_line()
    assert len(error.one_line()) < 400
    assert error.hint
    assert error.exit_code == ExitCode.USAGE


def test_loopback_hosts_are_one_machine() -> None:
    inv = inventory.parse("cluster: c\nimage: i\nhosts:\n  - {address: 127.0.0.1, role: head}\n")
    assert inv.head_address == "127.0.0.1"
    inv = inventory.parse(
        "cluster: c\nimage: i\nhosts:\n  - {address: 127.0.0.1, role: head}\n  - {address: 127.0.0.2}\n"
    )
    assert [str(w.address) for w in inv.workers] == ["127.0.0.2"]


def test_head_address_may_be_the_head_hosts_own() -> None:
    inv = inventory.parse_bytes((BASE + "head: {address: 192.0.2.11}\n").encode())
    assert inv.head_address == "192.0.2.11"


def test_merge_keys_and_anchors_are_not_duplicates() -> None:
    text = (
        "cluster: demo\nimage: i\nhosts:\n"
        "  - {address: 192.0.2.11, role: head, env: &e {A: '1'}}\n"
        "  - &w {address: 192.0.2.12, num_cpus: 2, env: *e}\n"
        "  - {<<: *w, num_cpus: 4, address: 192.0.2.13}\n"
    )
    inv = inventory.parse(text)
    assert [w.num_cpus for w in inv.workers] == [2, 4]
    assert inv.workers[1].env == {"A": "1"}
    with pytest.raises(InventoryError, match=r":6: hosts\[2\]\.num_cpus: duplicate key"):
        inventory.parse(text.replace("num_cpus: 4,", "num_cpus: 4, num_cpus: 5,"))


def test_load_reads_at_most_the_cap(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_bytes(BASE.encode() + b"#" * (3 * strict_yaml.MAX_BYTES))
    with pytest.raises(InventoryError, match="larger than"):
        inventory.load(path)
    path.write_bytes(BASE.encode())
    assert inventory.load(path).inventory.cluster == "demo"


def test_bom_is_accepted() -> None:
    assert inventory.parse_bytes(b"\xef\xbb\xbf" + BASE.encode()).cluster == "demo"


@pytest.mark.parametrize(
    "image",
    [
        "i",
        "raycluster/node:0.1.0",
        "localhost:5000/a/b_c__d-e.f:Tag_1.2-x",
        "Registry.Example.com/team/img",
        "[2001:db8::1]:5000/img:1",
        "img@sha256:" + "a" * 64,
        "img:1@sha256:" + "0" * 64,
    ],
)
def test_docker_accepts_these_images(image: str) -> None:
    assert image_problem(image) is None


@pytest.mark.parametrize(
    "image",
    ["", "--privileged", "img:", "img:-x", "a//b", "a/-b", "img@sha256:abc", "img\n", "a b", "A", "x" * 256, ":1"],
)
def test_docker_refuses_these_images(image: str) -> None:
    assert image_problem(image)


@pytest.mark.parametrize(
    ("name", "ok"), [("gpu-node-2", True), ("a.b", True), ("a-", False), ("a_b", False), ("", False)]
)
def test_hostnames(name: str, ok: bool) -> None:
    assert (hostname_problem(name) is None) == ok


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('cluster: "\\U99999999"\n', "inv.yaml:1: invalid YAML (an escape sequence it cannot decode"),
        ('cluster: "\\UFFFFFFFFFFFFFFFF"\n', "inv.yaml:1: invalid YAML (an escape sequence it cannot decode"),
    ],
)
def test_escapes_the_yaml_scanner_cannot_decode_are_inventory_errors(text: str, expected: str) -> None:
    """Found by the property suite: PyYAML's scanner raises ValueError/OverflowError for these."""
    with pytest.raises(InventoryError) as caught:
        inventory.parse(text, "inv.yaml")
    assert caught.value.message.startswith(expected)


def test_a_field_name_with_a_control_character_is_named_on_one_line() -> None:
    """Found by the property suite: an unknown key '\\r' under docker made a two-line message."""
    text = 'cluster: c\nimage: i\ndocker:\n  "\\r": 1\nhosts:\n  - {address: 10.0.0.1, role: head}\n'
    with pytest.raises(InventoryError) as caught:
        inventory.parse(text, "inv.yaml")
    assert "docker.'\\r'" in caught.value.message
    assert "\n" not in caught.value.one_line() and "\r" not in caught.value.one_line()
