"""`raycluster exec`: a command in this cluster's Ray container on one or more hosts, node env sourced.

The command's words are joined with spaces and run by `sh` inside the container, as `ssh HOST CMD…`
does, after the node's env file (the inventory's `env`, see `up`) is sourced. Never prints: each output
line goes to the callback the caller gives.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.errors import RayclusterError, UsageError
from raycluster_cli.host.containers import ENV_IN_CONTAINER, LABEL_CLUSTER, LABEL_ROLE, container_name
from raycluster_cli.transport import quote
from raycluster_cli.transport.engine_shim import engine_of, preamble
from raycluster_cli.transport.fanout import fanout
from raycluster_cli.transport.pool import Connect
from raycluster_cli.transport.stream import Stream, run_streamed

# What `exec` returns for a host where it could not run the command at all (host unreachable, no running
# container of this cluster): 255, as `ssh` does for its own failures.
NOT_RUN = 255
OutputSink = Callable[[str, Stream, str], None]


@dataclass
class ExecResult:
    host: str
    role: str
    rc: int
    stdout: str = ""
    stderr: str = ""
    error: str = ""  # why the command could not run (then rc is NOT_RUN)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_hosts(inventory: Inventory, addresses: list[str] | None, every: bool) -> list[HostConfig]:
    """The hosts `--host`/`--all` name (default: the head); unknown addresses are a usage error."""
    if every and addresses:
        raise UsageError("--all and --host exclude each other", "pass one of them")
    if every:
        return list(inventory.hosts)
    if not addresses:
        return [inventory.head_host]
    known = {str(h.address): h for h in inventory.hosts}
    unknown = [a for a in addresses if a not in known]
    if unknown:
        raise UsageError(
            f"--host {', '.join(unknown)} is not in the inventory", "use one of: " + ", ".join(known) + ", or --all"
        )
    return [known[a] for a in dict.fromkeys(addresses)]


def container_check_command(inventory: Inventory, host: HostConfig) -> str:
    labels = f'{{{{index .Config.Labels "{LABEL_CLUSTER}"}}}}/{{{{index .Config.Labels "{LABEL_ROLE}"}}}}'
    return f"docker inspect --format '{{{{.State.Status}}}} {labels}' {quote(container_name(inventory, host))}"


def exec_command(inventory: Inventory, host: HostConfig, words: list[str], tag: str | None = None) -> str:
    """`docker exec` of the joined words in the host's Ray container, after sourcing the node env.

    `docker exec` does not end the process it started in the container when its client dies, so the
    command runs in a session of its own (`setsid -w`) whose id it writes to a file in the container;
    when the host side is ended (the remote guard ends it when the connection goes, at the deadline, on
    Ctrl-C), its trap kills that whole session in the container — from a session of its own on the
    host, so the guard's final SIGKILL does not cut the trap short. The same stop runs when the `docker
    exec` client ends by itself while the command still runs; after a command that ended, its pid file is
    gone and the stop kills nothing."""
    name = quote(container_name(inventory, host))
    pidfile = f"/tmp/.raycluster-exec-{tag or secrets.token_hex(6)}"
    script = (
        f"echo $$ >{pidfile}; trap 'rm -f {pidfile}' EXIT; "
        f"if [ -r {ENV_IN_CONTAINER} ]; then set -a; . {ENV_IN_CONTAINER}; set +a; fi; " + " ".join(words)
    )
    inner = (
        f"if command -v setsid >/dev/null; then exec setsid -w sh -c {quote(script)}; fi; exec sh -c {quote(script)}"
    )
    stop = f"p=$(cat {pidfile}) && {{ kill -TERM -$p 2>/dev/null || kill -TERM $p; }}; rm -f {pidfile}"
    killer = preamble(engine_of(inventory, host)) + f"docker exec {name} sh -c {quote(stop)}"
    # TERM and HUP are ignored first (and so in the stop's own process until it has a session of its own): a
    # second signal to the session must not end the stop before it has left the session.
    stop_all = f"trap '' TERM HUP; $r sh -c {quote(killer)} >/dev/null 2>&1"
    # SIGPIPE ignored: once the connection is gone, the shell's stdout and stderr are pipes no one reads, and a
    # write there must not end it before its stop (with it, the lab's Ctrl-C test passed 17 of 17 runs against
    # 16 of 20 without; the write itself is not identified).
    return (
        f"trap '' PIPE; r=; command -v setsid >/dev/null && r=setsid; trap {quote(stop_all + '; exit 143')} TERM HUP; "
        f"docker exec {name} sh -c {quote(inner)} & wait $!; s=$?; {stop_all}; exit $s"
    )


def container_problem(
    inventory: Inventory, host: HostConfig, inspect_stdout: str, inspect_rc: int, inspect_stderr: str = ""
) -> str:
    """Why the command cannot run in the host's container ('' when it can) (pure)."""
    name = container_name(inventory, host)
    fields = inspect_stdout.split()
    said = inspect_stderr.strip().splitlines()
    if said and "no such" not in said[0].lower():
        return f"cannot ask the container engine on {host.address}: {said[0][:200]}"
    if inspect_rc != 0 or len(fields) < 2:
        return f"no container {name} on {host.address}: run `raycluster up`"
    if fields[1] != f"{inventory.cluster}/{host.role}":
        return f"container {name} on {host.address} was not started by this cluster"
    if fields[0] != "running":
        return f"container {name} on {host.address} is {fields[0]}: run `raycluster up`"
    return ""


def run_exec(
    inventory: Inventory,
    connect: Connect,
    hosts: list[HostConfig],
    words: list[str],
    *,
    on_output: OutputSink,
    timeout_s: float | None = None,
) -> list[ExecResult]:
    """Run the command on every host in parallel; each host's lines go to `on_output(host, stream, line)`."""
    if not words:
        raise UsageError("no command given", "put it after --, e.g. raycluster exec -- ray status")
    lock = threading.Lock()

    def one(host: HostConfig) -> ExecResult:
        transport = connect(host)
        found = transport.run(container_check_command(inventory, host), timeout=60)
        problem = container_problem(inventory, host, found.stdout, found.rc, found.stderr)
        if problem:
            return ExecResult(str(host.address), host.role, NOT_RUN, error=problem)

        def sink(stream: Stream, line: str) -> None:
            with lock:
                on_output(str(host.address), stream, line)

        done = run_streamed(transport, exec_command(inventory, host, words), sink, timeout_s)
        return ExecResult(str(host.address), host.role, done.rc, done.stdout, done.stderr)

    results = []
    for host, outcome in fanout(hosts, one):
        if outcome.value is not None:
            results.append(outcome.value)
        else:
            error = outcome.error
            message = error.one_line() if isinstance(error, RayclusterError) else f"{type(error).__name__}: {error}"
            results.append(ExecResult(str(host.address), host.role, NOT_RUN, error=message))
    return results


def worst(results: list[ExecResult]) -> int:
    """The exit code of several: the highest (0 only when every host's command succeeded)."""
    return max((r.rc for r in results), default=0)
