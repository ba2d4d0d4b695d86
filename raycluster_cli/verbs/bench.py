"""The operator's side of ``bench``: start the driver inside the head container, follow it, read its result.

The driver runs detached in the head's container (``docker exec -d``) with its options as a JSON
file and writes progress events to a file there; this side polls that file over the same SSH
connection every second and hands each event to the progress callback, so a long run shows its
phase and count, a lost SSH connection does not kill the run, and Ctrl-C stops the driver (and with
it every stage actor) before it returns.  Never prints.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from raycluster_cli import cancel
from raycluster_cli.bench.options import BenchOptions
from raycluster_cli.config.inventory import Inventory
from raycluster_cli.delivery.model_relay import place_model
from raycluster_cli.errors import OperationError, RayclusterError
from raycluster_cli.host.containers import container_name, inspect_name_command, parse_ps
from raycluster_cli.progress import Progress, quiet
from raycluster_cli.transport import Transport, quote
from raycluster_cli.transport.pool import Connect

RUN_ROOT = "/tmp/raycluster-bench"
POLL_S = 1.0
COMMAND_TIMEOUT_S = 60.0
STALL_S = 180.0  # polls that fail for this long: the head is gone
_END = "@@raycluster-rc"


@dataclass(frozen=True)
class BenchEvent:
    """One progress event of the driver: a phase (``pilot 2/3``), maybe a count (``requests 412/1000``)."""

    phase: str
    done: int | None = None
    total: int | None = None
    step: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchEvent:
        known = {"phase", "done", "total", "step", "t"}
        return cls(
            phase=str(data.get("phase", "")),
            done=data.get("done"),
            total=data.get("total"),
            step=data.get("step"),
            extra={k: v for k, v in data.items() if k not in known},
        )


class BenchFailed(OperationError):
    """The driver reported a failure; ``failure`` holds the lost stage and the counts when it was one."""

    def __init__(self, message: str, hint: str, failure: dict[str, Any] | None = None) -> None:
        super().__init__(message, hint)
        self.failure = failure or {}


class _Run:
    """One detached driver in the head container, addressed by its folder there."""

    def __init__(self, transport: Transport, container: str) -> None:
        self.transport = transport
        self.container = container
        self.folder = f"{RUN_ROOT}/{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        self.offset = 0

    def sh(self, script: str, stdin: bytes | None = None, timeout: float = COMMAND_TIMEOUT_S) -> str:
        flag = "-i " if stdin is not None else ""
        result = self.transport.run(
            f"docker exec {flag}{quote(self.container)} sh -c {quote(script)}", stdin=stdin, timeout=timeout
        )
        if not result.ok:
            raise OperationError(
                f"{self.container}: {result.first_line() or 'a command in the head container failed'}",
                "check the head container: raycluster status",
            )
        return result.stdout

    def start(self, options: BenchOptions) -> None:
        d = self.folder
        resolved = options.effective()  # --quick applied here, where it is known which flags were given
        self.sh(f"mkdir -p {d} && cat > {d}/options.json", stdin=resolved.model_dump_json().encode())
        driver = (
            f"python -m raycluster_cli.bench.driver --options @{d}/options.json --progress {d}/progress.jsonl"
            f" > {d}/result.json 2> {d}/driver.log"
        )
        script = f"cd {d} && ({driver} & echo $! > {d}/pid; wait $!; echo $? > {d}/rc)"
        result = self.transport.run(f"docker exec -d {quote(self.container)} sh -c {quote(script)}", timeout=30)
        if not result.ok:
            raise OperationError(f"{self.container}: could not start the benchmark: {result.first_line()}", "")

    def poll(self) -> tuple[list[dict[str, Any]], int | None]:
        """New progress events since the last poll, and the driver's exit status once it has one."""
        d = self.folder
        out = self.sh(
            f"tail -c +{self.offset + 1} {d}/progress.jsonl 2>/dev/null; echo {_END}; cat {d}/rc 2>/dev/null || true"
        )
        text, _, rc_text = out.rpartition(_END)
        complete = text[: text.rfind("\n") + 1] if "\n" in text else ""
        self.offset += len(complete.encode())
        events = []
        for line in complete.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                events.append(event)
        rc = rc_text.strip()
        return events, int(rc) if rc.lstrip("-").isdigit() else None

    def result(self) -> dict[str, Any]:
        text = self.sh(f"cat {self.folder}/result.json").strip()
        try:
            document: Any = json.loads(text.splitlines()[-1])
        except (ValueError, IndexError):
            document = None
        if not isinstance(document, dict):
            raise OperationError(
                f"{self.transport.host}: {self.container}: the benchmark produced no result",
                f"its log: docker exec {self.container} cat {self.folder}/driver.log (on the head host)",
            )
        return document

    def stop(self) -> None:
        """SIGINT to the driver (it shuts Ray down, which ends its actors), SIGKILL 10 s later if still there.

        Sent detached (``docker exec -d``) so it returns at once, and also after Ctrl-C: this thread is exempt
        from the cancellation flag for this one command, while every other thread still sees it (clearing the
        flag let queued host work start meanwhile).
        """
        d = self.folder
        script = f"p=$(cat {d}/pid 2>/dev/null) || exit 0; kill -INT $p; sleep 10; kill -KILL $p 2>/dev/null; true"
        with cancel.exempt(), contextlib.suppress(Exception):  # best effort: the interrupt must reach the caller
            self.transport.run(f"docker exec -d {quote(self.container)} sh -c {quote(script)}", timeout=5)

    def clean(self) -> None:
        self.sh(f"rm -rf {self.folder}")


def place_bench_model(
    inventory: Inventory, connect: Connect, options: BenchOptions, progress: Progress = quiet
) -> tuple[BenchOptions, list[dict[str, Any]]]:
    """`--model-path` naming a folder on this machine: relayed into every host's model cache where it is missing
    (delivery/model_relay.py), and the driver reads it there; any other path is passed on as one the nodes have."""
    if not options.model_path:
        return options, []
    path, _, copies = place_model(inventory, connect, options.model_path, progress)
    return options.model_copy(update={"model_path": path}), [asdict(c) for c in copies]


def run_bench(
    inventory: Inventory,
    connect: Connect,
    options: BenchOptions,
    *,
    timeout_s: float = 1800.0,
    progress: Callable[[BenchEvent], None] = lambda _: None,
) -> dict[str, Any]:
    """Run the benchmark driver inside the head's container; map each stage's node IP to its host."""
    head = inventory.head_host
    transport = connect(head)
    name = container_name(inventory, head)
    state = parse_ps(transport.run(inspect_name_command(name)).stdout)
    if not state or not state[0].running:
        raise OperationError(f"{head.address}: the cluster's head is not running", "start the cluster: raycluster up")
    run = _Run(transport, name)
    run.start(options)
    deadline = time.monotonic() + timeout_s
    host_of = _host_of(inventory)
    answered = time.monotonic()
    try:
        while True:
            try:
                events, rc = run.poll()
                answered = time.monotonic()
            except RayclusterError as exc:  # a slow or dropped poll: the driver runs on; retry until stalled
                if time.monotonic() - answered > STALL_S:
                    raise OperationError(
                        f"{head.address}: the head container did not answer for {STALL_S:.0f}s ({exc.message})",
                        "check the head host: raycluster status",
                    ) from None
                time.sleep(POLL_S)
                continue
            for event in events:
                if "node_ip" in event:
                    event["host"] = host_of.get(str(event["node_ip"]), event["node_ip"])
                progress(BenchEvent.from_dict(event))
            if rc is not None:
                break
            if time.monotonic() > deadline:
                run.stop()
                raise OperationError(
                    f"{head.address}: the benchmark did not finish within {timeout_s:.0f}s (stopped)",
                    "give it longer with --timeout, or make it shorter (--quick, --duration-s)",
                )
            time.sleep(POLL_S)
    except BaseException:
        run.stop()
        raise
    document = run.result()
    if not document.get("ok"):
        raise _failure(inventory, document, f"docker exec {name} cat {run.folder}/driver.log")
    run.clean()
    return name_hosts(inventory, document)


def _failure(inventory: Inventory, document: dict[str, Any], log_command: str) -> BenchFailed:
    failure = dict(document.get("failure") or {})
    if not failure:
        return BenchFailed(f"benchmark failed: {document.get('error', 'unknown error')}", f"its log: {log_command}")
    host = _host_of(inventory).get(str(failure.get("node_ip")), str(failure.get("node_ip")))
    failure["host"] = host
    message = (
        f"{host}: stage {failure.get('stage')} (replica {failure.get('replica')}) was lost after "
        f"{failure.get('completed')} of {failure.get('requests')} request(s) completed "
        f"({failure.get('failed')} not completed): {failure.get('error')}"
    )
    return BenchFailed(message, f"check {host} (raycluster status; raycluster logs --host {host})", failure)


def _host_of(inventory: Inventory) -> dict[str, str]:
    return {inventory.node_ip(h): str(h.address) for h in inventory.hosts}


def name_hosts(inventory: Inventory, document: dict[str, Any]) -> dict[str, Any]:
    """Add the inventory host next to every node IP the driver reported."""
    host_of = _host_of(inventory)
    refs = document.get("references", {})
    items = [
        *document.get("stages", []),
        *document.get("calibration", {}).get("nodes", []),
        *document.get("lost_nodes", []),
        *document.get("lost_in_run", []),
        refs.get("unsharded", {}),
        *document.get("replicas", []),
        *document.get("sweep", {}).get("points", []),
        *(document.get("memory") or {}).get("stages", []),
    ]
    for item in items:
        if "node_ip" in item:
            item["host"] = host_of.get(item["node_ip"], item["node_ip"])
        if "node_ips" in item:
            item["hosts"] = [host_of.get(ip, ip) for ip in item["node_ips"]]
    gap = refs.get("ceiling", {}).get("gap") or {}
    if gap.get("stage"):
        gap["stage"] = host_of.get(str(gap["stage"]), gap["stage"])
    return document
