"""A read-only command started right after the login, before the CLI asks for it (the 1-host verbs' start).

On one host, `status` and `doctor` each begin with one read-only command per host (status's look at the
container, doctor's facts batch): 0.2 s on the host that the CLI used to wait for after its imports. When the
last run of the same command line on the same inventory began with such a command on a host, logins.py starts
it again as soon as that host's login ends, and the CLI's own call gets its result (`SSHTransport.run`).

Only commands the code declares read-only are ever kept or started, and no command is ever read from disk: the
caller runs them inside `read_only(kind, args)`, naming a recipe (a builder registered with `builder`, and
its JSON arguments), and the transport records the first such recipe per host (`SSHTransport.first_read_only`).
The next run keeps only the recipe; once the inventory is validated, `build` makes the command again with the
code's own builder, from that inventory and host (a kept shell string could be anything someone wrote into the
state folder; issue 34, item 10). An unknown kind or arguments of the wrong shape start nothing.

The facts batch carries a random marker (so no output can forge its frames); it is made with a fresh one,
matched to the caller's with the marker blanked (`shape`), and its output handed over with the caller's marker
in its place (`rebrand`): the output was made before the caller's marker existed, so it cannot contain it either.
"""

from __future__ import annotations

import re
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from raycluster_cli.transport.base import CommandResult

MARKER_PREFIX = "@@raycluster-facts-"
_MARKER = re.compile(re.escape(MARKER_PREFIX) + r"[0-9a-f]{12}")
_BLANK = MARKER_PREFIX + "************"
_local = threading.local()


def new_marker() -> str:
    """A facts batch's marker: a random nonce no command output can guess."""
    return MARKER_PREFIX + secrets.token_hex(6)


Recipe = dict[str, Any]  # {"kind": a registered builder's name, "args": its JSON arguments}
# A builder: (inventory, host, args) → (the command, its timeout); None, or ValueError/TypeError/KeyError, for
# arguments it does not accept. The inventory and host are the config layer's (typed Any: no import up here).
Builder = Callable[[Any, Any, dict[str, Any]], "tuple[str, float | None] | None"]
_BUILDERS: dict[str, Builder] = {}
B = TypeVar("B", bound=Builder)


def builder(kind: str) -> Callable[[B], B]:
    """Register a function that makes a read-only command again from the inventory, the host and `args`."""

    def register(make: B) -> B:
        _BUILDERS[kind] = make
        return make

    return register


@contextmanager
def read_only(kind: str, args: dict[str, Any] | None = None) -> Iterator[None]:
    """Declare the commands run in this block (this thread) read-only, made by builder `kind` from `args`:
    the next run of this command line may make the same command again and start it ahead."""
    if kind not in _BUILDERS:
        raise KeyError(f"no read-only command builder {kind!r} is registered")
    before = getattr(_local, "recipe", None)
    _local.recipe = {"kind": kind, "args": dict(args or {})}
    try:
        yield
    finally:
        _local.recipe = before


def declared_read_only() -> Recipe | None:
    """The recipe of the read-only block this thread is in (None: not in one)."""
    recipe: Recipe | None = getattr(_local, "recipe", None)
    return recipe


def build(recipe: Any, inventory: Any, host: Any) -> tuple[str, float | None] | None:
    """The command (marker blanked) and timeout the code makes now for a kept `recipe` on `host`; None for a
    recipe that is not one (an unknown kind, arguments of another shape): then nothing is started ahead."""
    if not isinstance(recipe, dict) or not isinstance(recipe.get("args"), dict):
        return None
    make = _BUILDERS.get(recipe.get("kind"))  # type: ignore[arg-type]
    if make is None:
        return None
    try:
        made = make(inventory, host, recipe["args"])
    except (ValueError, TypeError, KeyError):
        return None
    if made is None:
        return None
    command, timeout = made
    return shape(command)[0], timeout


def shape(command: str) -> tuple[str, str | None]:
    """The command with its batch marker blanked, and that marker (None: it has none)."""
    found = _MARKER.search(command)
    if found is None:
        return command, None
    return command.replace(found.group(0), _BLANK), found.group(0)


def fill(blanked: str) -> tuple[str, str | None]:
    """A kept command made runnable: a fresh marker where it was blanked (and that marker)."""
    if _BLANK not in blanked:
        return blanked, None
    marker = new_marker()
    return blanked.replace(_BLANK, marker), marker


def rebrand(result: CommandResult, ran: str | None, wanted: str | None) -> CommandResult:
    """The output of a command run with marker `ran`, as the caller's command (marker `wanted`) would print it."""
    if ran is None or wanted is None or ran == wanted:
        return result
    return CommandResult(
        result.rc, result.stdout.replace(ran, wanted), result.stderr.replace(ran, wanted), result.window
    )


class Pending:
    """A command to start ahead on one host: its result once it ended (None: it failed to run at all).

    Whoever claims it first runs it: the thread that starts it after the login, or the CLI's own call when
    it comes first (the login is slow, or never got to this host). A call that finds it claimed by the other
    waits for it to end, which the command's own deadline bounds."""

    def __init__(self, marker: str | None) -> None:
        self.marker = marker
        self.done = threading.Event()
        self.result: CommandResult | None = None
        self.error: BaseException | None = None  # the host stopped answering under it: the CLI's call raises it
        self._lock = threading.Lock()
        self._claimed = False

    def claim(self) -> bool:
        """True for the first caller only."""
        with self._lock:
            claimed, self._claimed = self._claimed, True
            return not claimed
