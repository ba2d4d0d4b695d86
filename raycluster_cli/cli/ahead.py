"""SSH logins started before the CLI's own imports: what `doctor`, `status`, `down` (and `up`'s preflight) wait for.

On one host these verbs are mostly the interpreter's start, the imports (typer, the checks, the rendering)
and one login. `entry.main` (the `raycluster` command, `python -m raycluster_cli`) reads the inventory that the
command line names, by the CLI's own rules (`-i/--inventory`, else $RAYCLUSTER_INVENTORY, else
./inventory.yaml), and starts every host's login in the background; then it imports the CLI, which parses the
command line itself and takes this pool when it asks for the same inventory argument (`take`). Anything else
(another verb, --help, --debug, an inventory that does not load) starts nothing here: the CLI then does all of
it as before, with its own messages. This module never prints and imports neither typer nor rich.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    from raycluster_cli.config.inventory import HostConfig, LoadedInventory
    from raycluster_cli.transport.logins import QuickLogins
    from raycluster_cli.transport.pool import SSHPool

VERBS = frozenset({"doctor", "status", "down", "up"})  # verbs whose first step is a login into every host

_ahead: tuple[str | None, LoadedInventory, SSHPool] | None = None


@dataclass(frozen=True)
class _Kept:
    """What `remember` saves at the end of a run whose hosts are all reached directly (logins.save)."""

    path: Path  # the inventory file
    config_file: str | None  # the inventory's ssh config file
    parallel: int  # ssh.max_parallel_logins
    direct: dict[str, dict[str, Any]]  # each host's login parameters
    seen: dict[str, Any] | None  # what logins.start found kept from the last run
    argv: list[str]
    pool: SSHPool


_keep: _Kept | None = None


def inventory_argument(argv: Sequence[str]) -> tuple[bool, str | None]:
    """Whether to log in ahead for this command line, and its -i/--inventory value (None: the default)."""
    if not argv or argv[0] not in VERBS:
        return False, None
    path: str | None = None
    args = iter(argv[1:])
    for arg in args:
        if arg == "--":
            break
        if arg in ("--help", "--debug"):  # help logs into nothing; --debug wants every login in its log
            return False, None
        if arg in ("-i", "--inventory"):
            path = next(args, None)
            if path is None:
                return False, None
        elif arg.startswith("--inventory="):
            path = arg.partition("=")[2]
        elif arg.startswith("-i") and not arg.startswith("--"):
            path = arg[2:]
    return True, path


def start(argv: Sequence[str]) -> None:
    """Read the inventory and start its hosts' logins, if this command line is one that logs into them.

    The logins the last run of this inventory made start first, before the inventory is read (logins.py);
    the pool adopts each one the validated inventory asks for in the same way, and logs in to the rest."""
    global _ahead, _keep
    wanted, path = inventory_argument(argv)
    if not wanted:
        return
    quick = None
    try:
        from raycluster_cli.transport import logins

        quick, seen = logins.start(path)  # the last run's logins, before pydantic and the models
        from raycluster_cli.config import inventory
        from raycluster_cli.transport.pool import SSHPool

        loaded = inventory.load(path)
        inventory.check_key_files(loaded)
        inv = loaded.inventory
        adopt = quick if quick is not None and quick.parallel == inv.ssh.max_parallel_logins else None
        pool = SSHPool(inv, gate=adopt.gate if adopt else None)
        params = {str(h.address): pool.login_params(h) for h in inv.hosts}
        recipes = logins.first_recipes(seen, list(argv)) if adopt else {}
        for host in inv.hosts:
            taken = adopt.take(str(host.address), params[str(host.address)]) if adopt else None
            if taken is not None and adopt is not None:
                pool.adopt(host, *taken)
                _supply_first(adopt, loaded, host, recipes.get(str(host.address)))
        pool.log_in_ahead(inv.hosts)
        direct = {address: p for address, p in params.items() if p is not None}
        if len(direct) == len(params):  # no host behind a jump host: keep the routes for the next run
            _keep = _Kept(loaded.path, inv.ssh.config_file, inv.ssh.max_parallel_logins, direct, seen, list(argv), pool)
    except Exception:
        return  # the CLI reads the inventory again and reports the problem its own way
    finally:
        if quick is not None:
            quick.discard()  # every login the validated inventory did not ask for, unused
    _ahead = (path, loaded, pool)


# The modules that register the builders of read-only commands (prefetch.builder) and the facts they name.
RECIPE_MODULES = ("raycluster_cli.verbs.status", "raycluster_cli.checks.catalog", "raycluster_cli.host.diagnose")


def _supply_first(quick: QuickLogins, loaded: LoadedInventory, host: HostConfig, recipe: Any) -> None:
    """Start on this host, after its login, the read-only command the last run of this command line began
    with, as the code makes it now from the validated inventory (never a command read from the cache)."""
    if recipe is None:
        return
    import importlib

    from raycluster_cli.transport import prefetch
    from raycluster_cli.transport.engine_shim import engine_of, preamble

    for module in RECIPE_MODULES:
        importlib.import_module(module)
    built = prefetch.build(recipe, loaded.inventory, host)
    if built is not None:  # with the engine's preamble, as the pool's transport sends it (engine_shim.py)
        quick.supply(str(host.address), preamble(engine_of(loaded.inventory, host)) + built[0], built[1])


def take(path: str | None) -> tuple[LoadedInventory, SSHPool] | None:
    """The inventory and pool started ahead, if they were for this -i/--inventory value (once)."""
    global _ahead
    ahead, _ahead = _ahead, None
    if ahead is None:
        return None
    if ahead[0] != path:
        ahead[2].close()
        return None
    return ahead[1], ahead[2]


def remember() -> None:
    """Keep this run's logins and first read-only commands for the next run (logins.py); never fails."""
    global _keep
    keep, _keep = _keep, None
    if keep is None:
        return
    try:
        from raycluster_cli.transport import logins

        logins.save(
            keep.path, keep.config_file, keep.parallel, keep.direct, keep.seen, keep.argv, keep.pool.first_read_only()
        )
    except Exception:
        return
