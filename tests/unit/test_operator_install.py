"""The operator's install needs no Ray: the CLI and every verb it runs here import no ray, and every import is declared."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

from .conftest import refusing_inventory

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "raycluster_cli"
# Run inside the node image only (the head's probe, the benchmark, the service and the node-side rooms under them:
# the model families, the Ray-node runtime, image generation). placement/ is pure: the operator imports it.
IN_THE_IMAGE = ("host/probe.py", "bench/", "serve/", "models/", "node/", "diffusion/")
# Import name -> distribution name where they differ.
DISTRIBUTIONS = {"yaml": "pyyaml"}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _imported(path: Path) -> set[str]:
    """Top-level names of the modules ``path`` imports anywhere (also inside functions), relative imports left out."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_image_side_imports_ray() -> None:
    importers = sorted(str(p.relative_to(PACKAGE)) for p in _modules() if "ray" in _imported(p))
    assert importers and all(name.startswith(IN_THE_IMAGE) for name in importers), importers


def test_every_third_party_import_is_declared() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_dist(req) for req in project["dependencies"]}
    extras = {name: {_dist(req) for req in reqs} for name, reqs in project["optional-dependencies"].items()}
    missing = []
    for path in _modules():
        side = (
            core | extras["ray"] | extras["bench"] | extras["serve"]
            if str(path.relative_to(PACKAGE)).startswith(IN_THE_IMAGE)
            else core
        )
        for name in _imported(path) - set(sys.stdlib_module_names) - {"raycluster_cli"}:
            if DISTRIBUTIONS.get(name, name) not in side:
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, missing
    assert "ray" not in core and extras["ray"] == {"ray"}


def _dist(requirement: str) -> str:
    name = requirement
    for stop in "[<>=!~; ":
        name = name.split(stop)[0]
    return name.lower()


# Blocks ray for the rest of the process and records who asked for it; then runs verbs of the CLI
# against a host whose SSH port refuses at once, and imports every operator-side module.
_PROBE = r"""
import importlib, json, pathlib, sys, traceback
asked = []
class NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            frames = [f for f in traceback.extract_stack() if not f.filename.startswith(("<frozen", "<string"))]
            asked.append(f"{frames[-1].filename}:{frames[-1].lineno}" if frames else name)
            raise ImportError("ray is not installed on the operator machine")
sys.meta_path.insert(0, NoRay())
from typer.testing import CliRunner
import raycluster_cli
from raycluster_cli.cli.app import app
inventory, state = sys.argv[1], sys.argv[2]
codes = {}
for verb in (["doctor"], ["up", "--timeout", "5"], ["down"], ["status"], ["--help"], ["lab", "--help"]):
    args = verb + (["-i", inventory, "--json"] if "--help" not in verb else [])
    codes[" ".join(verb)] = CliRunner().invoke(app, args, env={"RAYCLUSTER_STATE_DIR": state}).exit_code
package = pathlib.Path(raycluster_cli.__file__).parent
for path in sorted(package.rglob("*.py")):
    rel = path.relative_to(package).as_posix()
    if not rel.startswith(("host/probe.py", "bench/", "serve/", "models/", "node/", "diffusion/")) and rel != "cli/__main__.py":
        importlib.import_module("raycluster_cli." + rel[:-3].replace("/", ".").removesuffix(".__init__"))
print(json.dumps({"codes": codes, "asked": asked, "loaded": sorted(m for m in sys.modules if m.split(".")[0] == "ray")}))
"""


def test_doctor_up_down_never_import_ray(tmp_path: Path) -> None:
    inventory = refusing_inventory(tmp_path, "connect_timeout_s: 3")
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(inventory), str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["asked"] == [] and report["loaded"] == [], report["asked"]
    # each verb ran (the host refused: a failure, not a usage error or a crash)
    assert report["codes"] == {"doctor": 1, "up --timeout 5": 1, "down": 1, "status": 1, "--help": 0, "lab --help": 0}
