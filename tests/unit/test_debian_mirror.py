"""scripts/debian-mirror.sh: the base image's mirror comes from this machine's apt sources, never from the project.

Each case writes an apt directory of its own (mirror names under the reserved ``.example`` domain) and runs
the real script with ``APT_DIR`` pointing there.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "debian-mirror.sh"

SECURITY_STANZA = """Types: deb
URIs: http://security.example/debian-security
Suites: bookworm-security
Components: main
"""
MAIN_STANZA = """Types: deb
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def _run(apt_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "DEBIAN_MIRROR"} | {"APT_DIR": str(apt_dir)} | env
    return subprocess.run(["bash", str(SCRIPT)], env=environ, capture_output=True, text=True, timeout=30)


def _apt(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # deb822, the security archive first: the main archive wins
        ({"sources.list.d/debian.sources": SECURITY_STANZA + "\n" + MAIN_STANZA}, "http://mirror.example/debian"),
        # a disabled stanza, a deb-src-only one and a comment are skipped; the key names are case-insensitive
        (
            {
                "sources.list.d/a.sources": "Types: deb\nURIs: http://off.example/debian\nSuites: bookworm\n"
                "Enabled: no\n\nTypes: deb-src\nURIs: http://src.example/debian\nSuites: bookworm\n\n"
                "# the local mirror\ntypes: deb\nuris: https://local.example/debian/\nsuites: bookworm\n",
            },
            "https://local.example/debian/",
        ),
        # an unusable scheme (cdrom:) is skipped for the next URI of the stanza
        (
            {"sources.list.d/m.sources": "Types: deb\nURIs: cdrom:[x]/ file:///srv/debian\nSuites: bookworm\n"},
            "file:///srv/debian",
        ),
        # one-line format with options, after a deb-src line and a security line
        (
            {
                "sources.list": "# comment\ndeb-src http://src.example/debian bookworm main\n"
                "deb http://security.example/debian-security bookworm-security main\n"
                "deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian bookworm main contrib\n",
            },
            "http://mirror.example/debian",
        ),
        # deb822 wins over the one-line files; *.list in sources.list.d is read too
        (
            {"sources.list.d/x.list": "deb http://old.example/debian bookworm main\n"},
            "http://old.example/debian",
        ),
        (
            {
                "sources.list.d/x.list": "deb http://old.example/debian bookworm main\n",
                "sources.list.d/debian.sources": MAIN_STANZA,
            },
            "http://mirror.example/debian",
        ),
        # a file the script must not read: only *.sources and *.list count
        (
            {
                "sources.list.d/other.sources.disabled": "Types: deb\nURIs: http://no.example/d\nSuites: bookworm\n",
                "sources.list.d/debian.sources": MAIN_STANZA,
            },
            "http://mirror.example/debian",
        ),
    ],
    ids=["security-first", "disabled-src-comment", "schemes", "one-line", "list-dir", "deb822-first", "suffix"],
)
def test_reads_the_mirror_from_apt_sources(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    result = _run(_apt(tmp_path, files))
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"


def test_environment_overrides_and_nothing_found_says_what_to_set(tmp_path: Path) -> None:
    apt = _apt(tmp_path, {"sources.list.d/debian.sources": MAIN_STANZA})
    assert _run(apt, DEBIAN_MIRROR="http://override.example/debian").stdout == "http://override.example/debian\n"
    empty = _apt(tmp_path / "empty", {"sources.list.d/debian.sources": SECURITY_STANZA})
    result = _run(empty)
    assert result.returncode == 1 and result.stdout == ""
    assert "set DEBIAN_MIRROR=URL" in result.stderr and str(empty) in result.stderr


def test_this_machine_gives_a_mirror_when_it_has_apt_sources() -> None:
    if not list(Path("/etc/apt/sources.list.d").glob("*.sources")) and not Path("/etc/apt/sources.list").exists():
        pytest.skip("this machine has no apt sources")
    result = _run(Path("/etc/apt"))
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"(https?|ftp|file)://\S+\n", result.stdout)


# A host name in a URL: letters, digits, dots and dashes with at least one dot and one letter.
_URL_HOST = re.compile(r"\b(?:https?|ftp)://([A-Za-z0-9.-]*[A-Za-z][A-Za-z0-9.-]*\.[A-Za-z0-9.-]+)")
_ALLOWED = (".example", ".invalid", ".test", ".localhost")
_XML_NAMESPACES = ("http://www.w3.org/2000/svg",)  # names inside documents (SVG's xmlns), never fetched


def test_no_tracked_file_names_a_host() -> None:
    """No registry, index or mirror host in the project: URLs name loopback, documentation addresses,
    placeholders or reserved example domains only (the mirror comes from apt, the index from pip's config)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=30)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    found = []
    for name in listed.stdout.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for namespace in _XML_NAMESPACES:
            text = text.replace(namespace, "")
        found += [f"{name}: {host}" for host in _URL_HOST.findall(text) if not host.endswith(_ALLOWED)]
    assert not found, found
