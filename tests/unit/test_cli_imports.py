"""`doctor`, `status` and `down` on a few hosts are mostly the interpreter's start and its imports: importing
the CLI must not load what only other verbs use. Each check runs in a fresh interpreter (this test process
has imported everything already). Fails if someone puts one of these imports back at the top of cli.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import refusing_inventory

# What `import raycluster_cli.cli.app` must leave out, and why it is heavy or unneeded there.
NOT_AT_IMPORT = [
    "raycluster_cli.verbs.bench",  # bench
    "raycluster_cli.checks.catalog",  # doctor and up (status and down use checks.parsers only)
    "raycluster_cli.checks.runner",
    "raycluster_cli.verbs.up",  # up
    "raycluster_cli.verbs.jobs",  # submit, dashboard (http.client, websockets)
    "raycluster_cli.verbs.metrics",
    "raycluster_cli.verbs.execute",  # exec
    "raycluster_cli.render.bench",
    "raycluster_cli.render.operate",
    "raycluster_cli.lab.hosts",  # lab (its flags' defaults are in config/defaults.py)
    "raycluster_cli.verbs.logs",  # logs (likewise)
    "raycluster_cli.verbs.status",  # status
    "raycluster_cli.verbs.down",  # down
    "tarfile",  # lab and logs
    "http.client",
    "rich",  # drawn on demand: a --json run that prints nothing on stderr never loads it
    "psutil",  # lab up
    "docker",  # the lab's SDK
    "ray",
    "torch",
    "unittest",  # pulled in by invoke (below)
]


def _modules_after(code: str) -> set[str]:
    script = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out.splitlines()[-1]))


def test_importing_the_cli_loads_no_other_verbs_modules() -> None:
    loaded = _modules_after("import raycluster_cli.cli.app")
    eager = sorted(m for m in NOT_AT_IMPORT if m in loaded)
    assert not eager, (
        f"imported at `import raycluster_cli.cli.app`: {eager} (import them inside the verb that needs them)"
    )


def test_paramikos_invoke_is_imported_only_when_used() -> None:
    """paramiko imports invoke only for ssh_config's `Match exec`: a stand-in defers it, and still works."""
    loaded = _modules_after(
        "import raycluster_cli.cli.app, paramiko.config\n"
        "assert type(sys.modules['invoke']).__name__ == '_Deferred'\n"
        "assert paramiko.config.invoke_import_error is None"
    )
    assert "invoke.tasks" not in loaded and "unittest" not in loaded
    used = _modules_after(
        "import raycluster_cli, paramiko.config\nassert paramiko.config.invoke.run('true', hide=True, warn=True).ok"
    )
    assert "invoke.runners" in used


def test_match_exec_in_ssh_config_still_runs(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text('Match exec "true"\n  User matched\nHost *\n  Port 2222\n')
    code = (
        "import raycluster_cli, paramiko\n"
        f"c = paramiko.SSHConfig.from_path({str(config)!r})\n"
        "print(c.lookup('192.0.2.1')['user'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "matched"


def test_progress_lines_without_a_terminal_do_not_import_rich() -> None:
    """`down --json` prints progress lines on stderr between two round trips to its hosts: where stderr is
    no terminal they are plain text, written without importing rich (on a terminal the bullet is dimmed)."""
    code = (
        "import io, os\n"
        "os.environ.pop('FORCE_COLOR', None); os.environ.pop('TTY_COMPATIBLE', None)\n"
        "from raycluster_cli.render.base import Output\n"
        "err = io.StringIO()\n"
        "output = Output(True, stderr=err)\n"
        "output.progress()('removing [x] on 1 host(s)')\n"
        "with output.live_progress() as progress:\n"
        "    progress('purging \\x1b[31mred\\x1b[0m')\n"
        "assert err.getvalue() == '· removing [x] on 1 host(s)\\n· purging red\\n', err.getvalue()\n"
    )
    assert "rich" not in _modules_after(code)


@pytest.mark.parametrize("verb", ["status", "down"])
def test_status_and_down_load_neither_the_checks_nor_rich(verb: str, tmp_path: Path) -> None:
    """The whole `raycluster status|down --json` against a loopback port that refuses at once."""
    inventory = refusing_inventory(tmp_path, "connect_retries: 0")
    code = (
        f"import os; os.environ['RAYCLUSTER_STATE_DIR'] = {str(tmp_path / 'state')!r}\n"
        f"sys.argv = ['raycluster', {verb!r}, '-i', {str(inventory)!r}, '--json']\n"
        "from raycluster_cli.cli import ahead, entry\n"
        "try:\n    entry.main()\nexcept SystemExit as exc:\n    assert exc.code == 1, exc.code\n"
    )
    loaded = _modules_after(code)
    assert {"status": "raycluster_cli.verbs.status", "down": "raycluster_cli.verbs.down"}[
        verb
    ] in loaded  # the verb ran
    heavy = ["raycluster_cli.checks.base", "raycluster_cli.checks.catalog", "raycluster_cli.checks.runner", "rich"]
    assert not [m for m in heavy if m in loaded]
