"""Per-host facts: a command plus a pure `process(output)`, gathered in one remote command per host and cached.

A verb asks for the facts it needs on each host once (`gather`); every check and step of the verb then judges
the cached results instead of running its own command. The commands of one gather run side by side on the host
inside one shell script (`batch_script`), each with its own stdout, stderr and exit status, under one deadline;
`parse_batch` splits the framed output again. pyinfra's `FactBase` is the model: the command is data, the
parser is pure, so parsing is tested from recorded output.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.transport import CommandResult, Transport, prefetch
from raycluster_cli.transport.batch import batch_script, parse_batch
from raycluster_cli.transport.fanout import fanout
from raycluster_cli.transport.pool import Connect

T = TypeVar("T")
KNOWN: dict[str, Fact[Any]] = {}  # every command fact the code defined, by name

HOST_DEADLINE_S = 120.0  # a fact still running after this is reported as timed out (rc 124); the others stand


@dataclass(frozen=True)
class HostContext:
    """What a fact's command (and a check's judgement) may depend on: the inventory and the host."""

    inventory: Inventory
    host: HostConfig

    @property
    def address(self) -> str:
        return str(self.host.address)


@dataclass(frozen=True)
class Fact(Generic[T]):
    """`command(ctx)` runs on the host (one line of POSIX sh); `process(result)` turns its output into T (pure).

    A `timed` fact's stdout is rewritten by the gather to `operator <sent> <received>` (this machine's clock
    around the remote command), the fact's own output, then `elapsed <s>` (the host's time between the
    start and the end of the batch), so that a clock reading can subtract the time the batch took: a clock
    fact prints the batch's own start (`batch.BATCH_START`), the one reading whose place in that time is known.

    A derived fact (see `derived`) runs nothing itself: `derive(ctx, results)` computes it from the results
    of the command facts it `needs`, so that one remote reading (one `docker info`, one `docker ps -a`) is
    shared by every check and step that judges part of it.

    A `quick` fact only reads the kernel's state or small local files (no engine, no network, no folder that
    may be a network mount): the batch runs it one after another with the other quick facts, in one job.
    """

    name: str
    command: Callable[[HostContext], str] | None
    process: Callable[[CommandResult], T]
    timed: bool = False
    needs: tuple[Fact[CommandResult], ...] = ()
    derive: Callable[[HostContext, list[CommandResult]], T] | None = None
    quick: bool = False

    def __post_init__(self) -> None:
        if self.command is not None:
            KNOWN[self.name] = self  # by name: what a kept recipe may ask for (prefetch.py, `_batch_again`)

    def commands(self) -> list[Fact[Any]]:
        """The command facts gathering this one needs: itself, or the facts it is derived from."""
        return list(self.needs) if self.derive is not None else [self]


def raw(
    name: str, command: Callable[[HostContext], str], timed: bool = False, quick: bool = False
) -> Fact[CommandResult]:
    """A fact whose value is the command's result itself (its judge parses it)."""
    return Fact(name, command, _identity, timed, quick=quick)


def _identity(result: CommandResult) -> CommandResult:
    return result


def derived(
    name: str, needs: tuple[Fact[CommandResult], ...], derive: Callable[[HostContext, list[CommandResult]], T]
) -> Fact[T]:
    """A fact computed on this machine from the results of `needs` (command facts), without a command of its own."""
    return Fact(name, None, _no_process, needs=needs, derive=derive)


def _no_process(result: CommandResult) -> Any:
    raise TypeError("a derived fact has no output of its own to process")


def command_facts(facts: Iterable[Fact[Any]]) -> list[Fact[Any]]:
    """The command facts to run for `facts` (derived ones replaced by what they need), each once, in order."""
    return list({f.name: f for fact in facts for f in fact.commands()}.values())


@dataclass
class HostFacts:
    """One host's gathered facts: each fact's result by name, processed (or derived) on first use and kept.

    `context` (the inventory and the host) is what derived facts are computed with; the cache sets it."""

    address: str
    results: dict[str, CommandResult] = field(default_factory=dict)
    context: HostContext | None = None
    _values: dict[str, Any] = field(default_factory=dict, repr=False)

    def has(self, fact: Fact[Any]) -> bool:
        return all(f.name in self.results for f in fact.commands())

    def result(self, fact: Fact[Any]) -> CommandResult:
        """The fact's command result; for a derived fact whose value is a CommandResult, that value."""
        if fact.derive is not None:
            value = self.get(fact)
            if not isinstance(value, CommandResult):
                raise TypeError(f"fact {fact.name!r} is derived into {type(value).__name__}, not a command result")
            return value
        try:
            return self.results[fact.name]
        except KeyError:
            raise KeyError(f"fact {fact.name!r} was not gathered on {self.address}") from None

    def get(self, fact: Fact[T]) -> T:
        if fact.name not in self._values:
            if fact.derive is not None:
                if self.context is None:
                    raise KeyError(f"fact {fact.name!r}: no host context on {self.address}")
                self._values[fact.name] = fact.derive(self.context, [self.result(n) for n in fact.needs])
            else:
                self._values[fact.name] = fact.process(self.result(fact))
        value: T = self._values[fact.name]
        return value

    def update(self, results: dict[str, CommandResult]) -> None:
        self.results.update(results)
        for name in results:
            self._values.pop(name, None)
        self._values = {k: v for k, v in self._values.items() if k in self.results}  # derived: computed again


def gather_host(
    transport: Transport, ctx: HostContext, facts: Iterable[Fact[Any]], deadline_s: float = HOST_DEADLINE_S
) -> dict[str, CommandResult]:
    """Run every fact's command on the host in one remote command; each fact's result by name.

    Raises (TransportError) only when the host cannot be reached or the batch itself breaks.
    """
    wanted = command_facts(facts)
    if not wanted:
        return {}
    marker = prefetch.new_marker()
    sent = time.time()
    recipe = {"facts": [f.name for f in wanted], "deadline_s": deadline_s}
    with prefetch.read_only("facts", recipe):  # facts only read: the next run of this command line may start it
        command, timeout = _batch(ctx, wanted, deadline_s, marker)
        out = transport.run(command, timeout=timeout)
    sent, received = out.window or (sent, time.time())  # when it really ran (ahead of this call, or now)
    batch = parse_batch(marker, out.stdout, len(wanted), deadline_s)
    if batch is None:
        return {f.name: CommandResult(out.rc or 1, "", f"fact batch broke: {out.first_line()}") for f in wanted}
    found = {}
    for fact, result in zip(wanted, batch.results, strict=True):
        if fact.timed:
            elapsed = f"elapsed {batch.elapsed:.6f}\n" if batch.elapsed is not None else ""
            result = CommandResult(result.rc, f"operator {sent:.6f} {received:.6f}\n{result.stdout}{elapsed}", "")
        found[fact.name] = result
    return found


def _batch(ctx: HostContext, wanted: list[Fact[Any]], deadline_s: float, marker: str) -> tuple[str, float]:
    """The one remote command that gathers `wanted` (command facts) on the host, and its timeout."""
    quick = [i for i, f in enumerate(wanted) if f.quick]
    return batch_script(marker, [_command(f, ctx) for f in wanted], deadline_s, quick), deadline_s + 30


@prefetch.builder("facts")
def _batch_again(inventory: Inventory, host: HostConfig, args: dict[str, Any]) -> tuple[str, float] | None:
    """A facts batch made again from its recipe (fact names, deadline) for the next run (prefetch.py): only
    facts this code defines, by name, and a deadline within bounds; anything else makes nothing."""
    names, deadline_s = args["facts"], float(args["deadline_s"])
    if not isinstance(names, list) or not 0 < deadline_s <= HOST_DEADLINE_S * 10:
        return None
    wanted = [KNOWN.get(name) if isinstance(name, str) else None for name in names]
    if not wanted or any(f is None or f.command is None for f in wanted):
        return None
    return _batch(HostContext(inventory, host), wanted, deadline_s, prefetch.new_marker())  # type: ignore[arg-type]


def _command(fact: Fact[Any], ctx: HostContext) -> str:
    if fact.command is None:
        raise TypeError(f"fact {fact.name!r} has no command (a derived fact needs command facts)")
    return fact.command(ctx)


Wanted = Callable[[HostContext], Iterable[Fact[Any]]]


class FactCache:
    """The facts of every host for one run of a verb: one `gather` is one remote command per host.

    A fact already gathered on a host is not asked again unless `refresh` names it (after `up` changed the
    host). A host that could not be reached keeps its error and is not asked again.
    """

    def __init__(self, inventory: Inventory, connect: Connect) -> None:
        self.inventory = inventory
        self.connect = connect
        self.facts: dict[str, HostFacts] = {}
        self.errors: dict[str, BaseException] = {}

    def gather(self, hosts: Iterable[HostConfig], wanted: Wanted, refresh: Iterable[Fact[Any]] = ()) -> None:
        """Gather on every host (in parallel) the facts `wanted(ctx)` names that it lacks, plus `refresh`."""
        again = {f.name for f in command_facts(refresh)}
        todo = [h for h in hosts if str(h.address) not in self.errors]
        fanout(todo, lambda host: self._gather_one(host, wanted, again), what="gather facts").check_interrupted()

    def _gather_one(self, host: HostConfig, wanted: Wanted, again: set[str]) -> None:
        address = str(host.address)
        facts = self.of(host)
        ctx = facts.context or HostContext(self.inventory, host)
        missing = [f for f in command_facts(wanted(ctx)) if f.name in again or not facts.has(f)]
        if not missing:
            return
        try:
            facts.update(gather_host(self.connect(host), ctx, missing))
        except Exception as exc:
            self.errors[address] = exc
            raise

    def of(self, host: HostConfig) -> HostFacts:
        address = str(host.address)
        if address not in self.facts:
            self.facts[address] = HostFacts(address, context=HostContext(self.inventory, host))
        return self.facts[address]

    def error(self, host: HostConfig) -> BaseException | None:
        return self.errors.get(str(host.address))
