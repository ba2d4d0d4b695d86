"""Many shell commands in one remote command: run side by side on the host, each output framed for the caller.

`batch_script` wraps commands into one POSIX sh script (each in the background, its stdout, stderr and exit
status in files, one watchdog for the deadline, every frame printed by one `cat`); `parse_batch` splits the framed output again. A marker line
with a random nonce separates the parts, so no output can forge one. `fake_batch_output` lets a fake transport
answer a batch command by command (unit tests keep their command → output tables).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from .base import CommandResult

TIMED_OUT_RC = 124
DEFAULT_DEADLINE_S = 90.0

# The batch: every command in the background with its output in files, one watchdog for the deadline, then
# the files framed by a marker line that cannot occur in the output (it carries a random nonce).
_JOB = '{{ ( {command} ) >"$t/{i}.o" 2>"$t/{i}.e" </dev/null; echo $? >"$t/{i}.r"; }} </dev/null >/dev/null 2>&1 & p="$p $!"'
_JOB_LINE = re.compile(r'^\{ \( (?P<command>.*) \) >"\$t/(?P<i>\d+)\.o" 2>"\$t/\d+\.e" </dev/null; ')


def batch_script(marker: str, commands: list[str], deadline_s: float = DEFAULT_DEADLINE_S) -> str:
    """One POSIX sh script running `commands` side by side; see `parse_batch` for its output."""
    for command in commands:
        if "\n" in command:
            raise ValueError(f"a fact's command must be one line: {command!r}")
    indexes = " ".join(str(i) for i in range(len(commands)))
    lines = [
        f"m={marker}",
        't=$(mktemp -d 2>/dev/null) || { t=/tmp/raycluster-facts-$$; mkdir -p "$t"; } || exit 1',
        "s0=$(date +%s.%N)",
        'p=""',
        *(_JOB.format(command=command, i=i) for i, command in enumerate(commands)),
        f"( trap 'kill $w 2>/dev/null; exit 0' TERM; sleep {deadline_s:.0f} & w=$!; wait $w; kill $p 2>/dev/null )"
        " </dev/null >/dev/null 2>&1 & d=$!",
        "wait $p",
        "kill $d 2>/dev/null",
        # The frames are written by the shell's builtins into files, then one `cat` prints every file in order
        # (a cat per file and a `mv` per command were most of the batch's own cost on a busy host).
        "set --",
        f"for i in {indexes}; do",
        "  r=" + str(TIMED_OUT_RC) + '; [ -s "$t/$i.r" ] && read -r r <"$t/$i.r"',
        '  printf \'%s out %s\\n\' "$m" "$i" >"$t/$i.a"; printf \'\\n%s err %s\\n\' "$m" "$r" >"$t/$i.b"',
        f'  {{ [ -s "$t/$i.r" ] || echo "raycluster: still running after {deadline_s:.0f}s on the host: stopped"; '
        "printf '\\n'; } >\"$t/$i.c\"",
        '  set -- "$@" "$t/$i.a" "$t/$i.o" "$t/$i.b" "$t/$i.e" "$t/$i.c"',
        "done",
        'cat "$@" 2>/dev/null',
        'printf \'%s time %s %s\\n\' "$m" "$s0" "$(date +%s.%N)"',
        'rm -rf "$t"',
    ]
    return "\n".join(lines) + "\n"


def split_batch(script: str) -> list[str] | None:
    """The commands of a batch script in order (for fakes that answer each command from a table); None if
    `script` is not a batch."""
    if not script.startswith("m=@@raycluster-facts-"):
        return None
    jobs = [_JOB_LINE.match(line) for line in script.splitlines()]
    return [m.group("command") for m in jobs if m is not None]


@dataclass(frozen=True)
class Batch:
    results: list[CommandResult]
    elapsed: float | None  # the host's seconds from the start to the end of the batch


def parse_batch(marker: str, text: str, count: int) -> Batch | None:
    """The framed output of `batch_script`: per command `M out I`, its stdout, `M err RC`, its stderr (pure)."""
    line = re.compile(rf"^{re.escape(marker)} (out|err|time) (.*)$", re.M)
    marks = list(line.finditer(text))
    outs: dict[int, str] = {}
    errs: dict[int, tuple[int, str]] = {}
    elapsed = None
    current = -1
    for n, mark in enumerate(marks):
        end = marks[n + 1].start() if n + 1 < len(marks) else len(text)
        body = text[mark.end() + 1 : end]
        body = body[:-1] if body.endswith("\n") else body
        kind, value = mark.group(1), mark.group(2).strip()
        if kind == "out" and value.isdigit():
            current = int(value)
            outs[current] = body
        elif kind == "err" and current >= 0:
            errs[current] = (int(value) if value.lstrip("-").isdigit() else TIMED_OUT_RC, body)
        elif kind == "time":
            elapsed = _elapsed(value)
    if set(outs) != set(range(count)) or set(errs) != set(range(count)):
        return None
    return Batch([CommandResult(errs[i][0], outs[i], errs[i][1]) for i in range(count)], elapsed)


def _elapsed(value: str) -> float | None:
    try:
        start, end = (float(part) for part in value.split())
    except ValueError:
        return None  # busybox's date prints a literal %N: no sub-second stamps
    return end - start if end >= start else None


def fake_batch_output(script: str, answer: Callable[[str], CommandResult]) -> CommandResult:
    """What `batch_script` prints when each of its commands gives `answer(command)` (for fake transports)."""
    commands = split_batch(script)
    assert commands is not None
    marker = script.split("\n", 1)[0].removeprefix("m=")
    parts = []
    for i, command in enumerate(commands):
        result = answer(command)
        parts.append(f"{marker} out {i}\n{result.stdout}\n{marker} err {result.rc}\n{result.stderr}\n")
    now = time.time()
    parts.append(f"{marker} time {now:.6f} {now:.6f}\n")
    return CommandResult(0, "".join(parts), "")
