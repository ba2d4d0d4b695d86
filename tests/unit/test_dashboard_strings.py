"""What Ray's dashboard says (a job's submission_id, status and message, Ray's version) reaches the terminal
escaped, and the printed stop command quotes the id (issue 34, item 12): the dashboard is reachable by anyone
who can submit a job, so its strings are remote input like a host's."""

from __future__ import annotations

import io
import shlex

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.render.base import Output
from raycluster_cli.render.operate import render_dashboard, render_interrupted_job, render_submit
from raycluster_cli.verbs.jobs import JobResult, stop_hint

from .conftest import EXAMPLE

HOSTILE = "x\x1b]52;c;ZXZpbA==\x07\x1b[2J[/red][link=http://evil]y"
CONTROL = "\x1b\x9b\x07\x08\x00\r"


def _output() -> tuple[Output, io.StringIO]:
    err = io.StringIO()
    return Output(False, stdout=io.StringIO(), stderr=err), err


@pytest.mark.parametrize("waited", [True, False])
def test_a_jobs_id_status_and_message_are_printed_escaped(waited: bool) -> None:
    output, err = _output()
    job = {"submission_id": HOSTILE, "status": HOSTILE, "driver_exit_code": 1, "message": HOSTILE, "waited": waited}
    render_submit(output, {"job": job})
    text = err.getvalue()
    assert not any(ch in text for ch in CONTROL)
    assert "[/red][link=http://evil]y" in text  # shown as text, not taken as markup


def test_rays_version_is_printed_escaped() -> None:
    output, err = _output()
    body = {"cluster": "demo", "url": "http://127.0.0.1:8265", "head_dashboard": "192.0.2.11:8265",
            "ray_version": HOSTILE}  # fmt: skip
    render_dashboard(output, body)
    assert not any(ch in err.getvalue() for ch in CONTROL)


def test_the_stop_command_quotes_the_id() -> None:
    inv = inventory.parse(EXAMPLE)
    hint = stop_hint(inv, "raysubmit_1; rm -rf ~")
    assert shlex.split(hint)[-1] == "raysubmit_1; rm -rf ~"
    output, err = _output()
    assert render_interrupted_job(output, "demo", JobResult(HOSTILE, "RUNNING"), stop_hint(inv, HOSTILE)) == 130
    assert not any(ch in err.getvalue() for ch in CONTROL)
