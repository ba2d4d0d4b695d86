"""The Ray version the CLI expects is pinned the same way everywhere it is written down."""

from __future__ import annotations

import re
from pathlib import Path

from raycluster_cli.versions import RAY_VERSION

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_pins_the_expected_ray() -> None:
    pins = re.findall(r'"ray\[default\]==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pins == [RAY_VERSION]


def test_node_dockerfile_defaults_to_the_expected_ray() -> None:
    (default,) = re.findall(r"^ARG RAY_VERSION=(\S+)$", (ROOT / "docker/node/Dockerfile").read_text(), re.M)
    assert default == RAY_VERSION


def test_build_script_reads_the_version_from_versions_py() -> None:
    script = (ROOT / "scripts/build-images.sh").read_text()
    assert "raycluster_cli/versions.py" in script and '--build-arg RAY_VERSION="$RAY_VERSION"' in script
