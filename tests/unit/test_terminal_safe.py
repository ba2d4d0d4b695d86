"""Text from hosts never drives the operator's terminal: control sequences are stripped where it is printed."""

from __future__ import annotations

import io
import json

import pytest

from raycluster_cli.render.base import Output, render_logs
from raycluster_cli.render.operate import ExecPrinter, JobLogPrinter
from raycluster_cli.render.text import terminal_safe

HOSTILE = "boom\x1b[2J\x1b[H\x1b]0;pwned\x07\x1b]52;c;ZXZpbA==\x07\x9b31m\x1bPq#0\x1b\\\r\x08\x00 done"


@pytest.mark.parametrize(
    ("raw", "safe"),
    [
        ("\x1b[31mred\x1b[0m", "red"),
        ("a\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\", "alink"),
        ("tab\tand\nlines\r\n", "tab\tand\nlines\n"),
        ("unicode é 日本", "unicode é 日本"),
        (HOSTILE, "boom done"),
    ],
)
def test_terminal_safe(raw: str, safe: str) -> None:
    assert terminal_safe(raw) == safe


def _output(json_mode: bool = False) -> tuple[Output, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    return Output(json_mode, stdout=out, stderr=err), out, err


def test_errors_details_progress_and_lines_are_stripped() -> None:
    output, out, err = _output()
    output.error(f"192.0.2.12: docker load failed: {HOSTILE}", f"hint {HOSTILE}")
    output.details([{"cause": HOSTILE, "log_tail": [HOSTILE]}])
    output.progress()(HOSTILE)
    output.warning(HOSTILE)
    output.line(HOSTILE)
    for text in (out.getvalue(), err.getvalue()):
        assert "boom done" in text
        assert not any(ch in text for ch in "\x1b\x9b\x07\x08\x00\r")


def test_logs_table_shows_the_first_error_line_stripped() -> None:
    output, out, _ = _output()
    host = {"host": "192.0.2.12", "files": 1, "bytes": 10, "error_lines": 1, "error": "", "first_errors": [HOSTILE]}
    render_logs(output, {"out": "/x", "hosts": [host]})
    assert "boom done" in out.getvalue() and "\x1b" not in out.getvalue()


def test_json_keeps_the_text_without_raw_escapes() -> None:
    output, out, _ = _output(json_mode=True)
    output.document(False, {"error": {"message": HOSTILE}})
    raw = out.getvalue()
    assert not any(ch in raw for ch in "\x1b\x9b\x07\x00")
    assert json.loads(raw)["error"]["message"] == HOSTILE


def test_exec_and_job_log_lines_are_stripped() -> None:
    output, out, _ = _output()
    ExecPrinter(output, prefixed=True)("192.0.2.12", "stdout", HOSTILE)
    JobLogPrinter(output)(HOSTILE + "\n")
    assert out.getvalue() == "192.0.2.12      | boom done\nboom done\n"
