"""Where a command's run spent the machine's CPU, process by process: every process on this machine (the lab's hosts
share its kernel, so their Ray processes are here too), read before and after COMMAND, grouped by container and by
what the process is (Ray titles its workers ``ray::ProxyActor``, ``ray::ServeReplica:...``, ``ray::_StageActor``).

Issue 49's E1: the service's decode steps took twice the CPU of their stage's forward; this says which process
took the rest (the ingress, Serve's proxy, Ray's raylet and GCS, the stage actor's own per-call work).

Usage: python benchmarks/cpu_by_process.py [--out FILE.json] [--top N] -- COMMAND...  (the document on stdout
without --out)
A process that began during the run counts whole; one that ended during it is lost (said in ``ended``), but for
the command's own (``command_cpu_s``: the client, when COMMAND is a benchmark's).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from _report import emit

Key = tuple[int, float]  # pid, create time: a pid reused during the run is another process


def _container(pid: int) -> str:
    """The container a process runs in: the last 12 hex digits of its cgroup path's docker id, else "host"."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return "?"
    for part in reversed(text.replace("\n", "/").split("/")):
        part = part.removeprefix("docker-").removesuffix(".scope")
        if len(part) == 64 and all(c in "0123456789abcdef" for c in part):
            return part[:12]
    return "host"


def _what(process: psutil.Process) -> str:
    try:
        cmdline = process.cmdline()
        name = process.name()
    except (psutil.Error, OSError):
        return "?"
    if cmdline and cmdline[0].startswith("ray::"):
        return cmdline[0].split()[0]
    for known in ("raylet", "gcs_server", "dashboard", "runtime_env", "log_monitor", "monitor.py", "agent"):
        if any(known in part for part in cmdline[:3]):
            return known
    return name


def threads_of(pattern: str) -> dict[tuple[int, int], tuple[float, str]]:
    """Each thread of the processes whose title contains ``pattern``: (CPU seconds, its name), by (pid, tid)."""
    found: dict[tuple[int, int], tuple[float, str]] = {}
    for process in psutil.process_iter():
        try:
            if pattern not in _what(process):
                continue
            for thread in process.threads():
                try:
                    name = Path(f"/proc/{process.pid}/task/{thread.id}/comm").read_text().strip()
                except OSError:
                    name = "?"
                found[(process.pid, thread.id)] = (thread.user_time + thread.system_time, name)
        except (psutil.Error, OSError):
            continue
    return found


def snapshot() -> dict[Key, tuple[float, str, str]]:
    """Every process: (CPU seconds, what it is, its container)."""
    found: dict[Key, tuple[float, str, str]] = {}
    for process in psutil.process_iter():
        try:
            times = process.cpu_times()
            key = (process.pid, process.create_time())
            found[key] = (times.user + times.system, _what(process), _container(process.pid))
        except (psutil.Error, OSError):
            continue
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--threads-of", default="", help="also each thread's CPU of the processes titled so")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    before = snapshot()
    threads_before = threads_of(args.threads_of) if args.threads_of else {}
    began = time.monotonic()
    rc = subprocess.call(command)
    wall = time.monotonic() - began
    own = resource.getrusage(resource.RUSAGE_CHILDREN)  # the command itself (it ended: not in the snapshots)
    after = snapshot()
    threads_after = threads_of(args.threads_of) if args.threads_of else {}
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for key, (cpu, what, container) in after.items():
        spent = cpu - before[key][0] if key in before else cpu
        row = rows.setdefault((container, what), {"container": container, "what": what, "cpu_s": 0.0, "processes": 0})
        row["cpu_s"] += max(0.0, spent)
        row["processes"] += 1
    ended = sum(1 for key in before if key not in after)
    table = sorted(rows.values(), key=lambda r: -r["cpu_s"])
    total = sum(r["cpu_s"] for r in table)
    for row in table:
        row["cpu_s"] = round(row["cpu_s"], 2)
        row["share"] = round(row["cpu_s"] / total, 3) if total else None
    report = {
        "command": command,
        "rc": rc,
        "wall_s": round(wall, 2),
        "cpu_s": round(total, 2),
        "command_cpu_s": round(own.ru_utime + own.ru_stime, 2),
        "ended": ended,
        "by_process": table[: args.top],
    }
    if args.threads_of:
        by_name: dict[str, float] = {}
        for key, (cpu, name) in threads_after.items():
            by_name[name] = by_name.get(name, 0.0) + max(0.0, cpu - threads_before.get(key, (0.0, ""))[0])
        report["threads"] = {
            "of": args.threads_of,
            "by_name": {name: round(cpu, 2) for name, cpu in sorted(by_name.items(), key=lambda kv: -kv[1])},
        }
    if args.out:  # the command's own output stays alone on stdout
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    else:
        emit(report, None)
    return rc


if __name__ == "__main__":
    sys.exit(main())
