"""`defer_metadata` (the CLI's start): paramiko's import reads its version without importlib.metadata; any
other use of importlib.metadata gets the real module; pydantic plugins are off only while the CLI's models are
built, and never against the user's own setting. Each case runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _run(code: str, env: dict[str, str] | None = None) -> dict[str, object]:
    script = f"import json, os, sys\n{code}\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_paramiko_gets_its_version_without_importlib_metadata() -> None:
    real = _run("import importlib.metadata as m; print(json.dumps({'v': m.version('paramiko')}))")["v"]
    seen = _run(
        "import raycluster_cli\nraycluster_cli.defer_metadata()\nimport paramiko\n"
        "print(json.dumps({'v': paramiko.__version__, 'email': 'email' in sys.modules,"
        " 'stand_in': type(sys.modules['importlib.metadata']).__name__}))"
    )
    assert seen == {"v": real, "email": False, "stand_in": "_Metadata"}


def test_anything_else_gets_the_real_module() -> None:
    seen = _run(
        "import raycluster_cli\nraycluster_cli.defer_metadata()\n"
        "from importlib.metadata import entry_points, version\n"
        "import importlib.metadata as m\n"
        "names = [d.metadata['Name'] for d in m.distributions()]\n"
        "print(json.dumps({'real': type(sys.modules['importlib.metadata']).__name__,"
        " 'pydantic': 'pydantic' in [n.lower() for n in names], 'missing': raycluster_cli.startup._installed_version('no-such-dist'),"
        " 'ours': [e.value for e in entry_points(group='console_scripts') if e.name == 'raycluster']}))"
    )
    assert seen == {
        "real": "module",
        "pydantic": True,
        "missing": None,
        "ours": ["raycluster_cli.cli.entry:main"],  # the real entry points: our own console script is found
    }


@pytest.mark.parametrize(("given", "during", "after"), [(None, "__all__", None), ("logfire", "logfire", "logfire")])
def test_pydantic_plugins_are_off_only_while_the_cli_starts(
    given: str | None, during: str | None, after: str | None
) -> None:
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYDANTIC_DISABLE_PLUGINS"}
    if given is not None:
        env["PYDANTIC_DISABLE_PLUGINS"] = given
    seen = _run(
        "import raycluster_cli\nundo = raycluster_cli.defer_metadata()\n"
        "during = os.environ.get('PYDANTIC_DISABLE_PLUGINS')\nundo()\n"
        "print(json.dumps({'during': during, 'after': os.environ.get('PYDANTIC_DISABLE_PLUGINS')}))",
        env,
    )
    assert seen == {"during": during, "after": after}
