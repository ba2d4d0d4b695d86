"""Many shell commands in one remote command: run side by side on the host, each output framed for the caller.

`batch_script` wraps commands into one POSIX sh script (each in the background, its stdout and stderr in files
that its own frame lines open and close, one watchdog for the deadline, every file printed by one `cat`);
`parse_batch` splits the framed output again. A marker line with a random nonce separates the parts, so no
output can forge one. `fake_batch_output` lets a fake transport answer a batch command by command (unit tests
keep their command → output tables).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from raycluster_cli.transport.base import CommandResult

TIMED_OUT_RC = 124
DEFAULT_DEADLINE_S = 90.0

# The batch: commands in the background, one watchdog for the deadline, then one `cat` of every file. A
# command's stdout file starts with its `out` frame line and its stderr file with its `err` line; the job
# appends its exit status (`rc`) to the stderr file when the command ends. The shell's builtins write the
# frames: a host runs no process for them. A command runs in a job of its own or (`quick`: reads of the
# kernel and of small local files) one after another with the other quick ones in one shared job: two
# processes fewer on the host for each (a shell and its subshell). Each frame line starts a line of its own
# (a newline before it), and the parser takes that newline off what precedes it.
_RUN = (
    'printf \'\\n%s out {i}\\n\' "$m" >"$t/{i}.o"; printf \'\\n%s err {i}\\n\' "$m" >"$t/{i}.e"; '
    '( {command} ) >>"$t/{i}.o" 2>>"$t/{i}.e" </dev/null; printf \'\\n%s rc {i} %s\\n\' "$m" $? >>"$t/{i}.e"'
)
_BACKGROUND = ' </dev/null >/dev/null 2>&1 & p="$p $!"'
_JOB_LINE = re.compile(
    r"""^(?:\{ )?printf '\\n%s out (?P<i>\d+)\\n' "\$m" >"\$t/\d+\.o"; printf '\\n%s err \d+\\n' "\$m" >"\$t/\d+\.e"; """
    r"""\( (?P<command>.*) \) >>"\$t/\d+\.o" 2>>"\$t/\d+\.e" </dev/null; printf """
)
# The host's clock. (Not bash's $EPOCHREALTIME, a process less: the lab plays a host whose clock is off with
# a `date` in front of the real one, which the builtin would not see.)
NOW = "$(date +%s.%N)"
# What a command of the batch prints to give the host's clock when the batch started, before any command (a
# command's own reading may wait behind the others on a busy host: a clock reading needs a known place).
BATCH_START = '"$s0"'


def batch_script(
    marker: str, commands: list[str], deadline_s: float = DEFAULT_DEADLINE_S, quick: Collection[int] = ()
) -> str:
    """One POSIX sh script running `commands` side by side (those whose index is in `quick` one after
    another in one job); see `parse_batch` for its output."""
    for command in commands:
        if "\n" in command:
            raise ValueError(f"a fact's command must be one line: {command!r}")
    together = [i for i in range(len(commands)) if i in quick]
    jobs = ["{ " + _RUN.format(command=c, i=i) + "; }" + _BACKGROUND for i, c in enumerate(commands) if i not in quick]
    if together:
        jobs += ["{ :", *(_RUN.format(command=commands[i], i=i) for i in together), "}" + _BACKGROUND]
    files = " ".join(f'"$t/{i}.o" "$t/{i}.e"' for i in range(len(commands)))
    lines = [
        f"m={marker}",
        't=$(mktemp -d 2>/dev/null) || { t=/tmp/raycluster-facts-$$; mkdir -p "$t"; } || exit 1',
        f"s0={NOW}",
        'p=""',
        *jobs,
        f"( trap 'kill $w 2>/dev/null; exit 0' TERM; sleep {deadline_s:.0f} & w=$!; wait $w; kill $p 2>/dev/null )"
        " </dev/null >/dev/null 2>&1 & d=$!",
        "wait $p",
        "kill $d 2>/dev/null",
        f"cat {files} 2>/dev/null",  # a quick command that never started has no files
        f'printf \'\\n%s time %s %s\\n\' "$m" "$s0" "{NOW}"',
        'rm -rf "$t"',
    ]
    return "\n".join(lines) + "\n"


def split_batch(script: str) -> list[str] | None:
    """The commands of a batch script in order (for fakes that answer each command from a table); None if
    `script` is not a batch."""
    if not script.startswith("m=@@raycluster-facts-"):
        return None
    jobs = [_JOB_LINE.match(line) for line in script.splitlines()]
    found = {int(m.group("i")): m.group("command") for m in jobs if m is not None}
    return [found[i] for i in sorted(found)]


@dataclass(frozen=True)
class Batch:
    results: list[CommandResult]
    elapsed: float | None  # the host's seconds from the start to the end of the batch


def parse_batch(marker: str, text: str, count: int, deadline_s: float = DEFAULT_DEADLINE_S) -> Batch | None:
    """The framed output of `batch_script` (pure): per command `M out I` and its stdout, `M err I` and its
    stderr, `M rc I RC`; then `M time <start> <end>`. A command without `rc` was still running at the deadline;
    one without `out` never started (a quick one behind it was still running). Without the `time` line the
    batch itself broke: None."""
    line = re.compile(rf"^{re.escape(marker)} (out|err|rc|time) (.*)$", re.M)
    marks = list(line.finditer(text))
    outs: dict[int, str] = {}
    errs: dict[int, str] = {}
    rcs: dict[int, int] = {}
    timeline: str | None = None
    for n, mark in enumerate(marks):
        end = marks[n + 1].start() if n + 1 < len(marks) else len(text)
        body = text[mark.end() + 1 : end]
        body = body[:-1] if body.endswith("\n") else body
        kind, fields = mark.group(1), mark.group(2).split()
        if kind == "time":
            timeline = mark.group(2).strip()
        elif fields and fields[0].isdigit():
            i = int(fields[0])
            if kind == "out":
                outs[i] = body
            elif kind == "err":
                errs[i] = body
            elif len(fields) > 1 and fields[1].lstrip("-").isdigit():
                rcs[i] = int(fields[1])
    if timeline is None:
        return None
    deadline = f"{deadline_s:.0f}s"
    results = []
    for i in range(count):
        if i not in outs:
            stopped = f"raycluster: not started: the command before it on the host was still running after {deadline}"
            results.append(CommandResult(TIMED_OUT_RC, "", stopped + "\n"))
        elif i not in rcs:
            err = errs.get(i, "")
            stopped = f"raycluster: still running after {deadline} on the host: stopped\n"
            results.append(
                CommandResult(TIMED_OUT_RC, outs[i], err + ("\n" if err and not err.endswith("\n") else "") + stopped)
            )
        else:
            results.append(CommandResult(rcs[i], outs[i], errs.get(i, "")))
    return Batch(results, _elapsed(timeline))


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
        parts.append(
            f"\n{marker} out {i}\n{result.stdout}\n{marker} err {i}\n{result.stderr}\n{marker} rc {i} {result.rc}\n"
        )
    now = time.time()
    parts.append(f"\n{marker} time {now:.6f} {now:.6f}\n")
    return CommandResult(0, "".join(parts), "")
