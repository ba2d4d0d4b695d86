"""Stand-ins that keep two slow imports out of every verb's start: `invoke` (paramiko imports it for one rare
ssh_config line) and `importlib.metadata` (paramiko and pydantic ask it for versions and plugins).

Imported by the package's __init__ (``_defer_invoke`` must run before paramiko is imported); `cli/entry.py` calls
``defer_metadata`` before the inventory's models are built.
"""

import importlib
import importlib.util
import os
import re
import sys
import threading
import types
from collections.abc import Callable
from typing import Any


class _Deferred(types.ModuleType):
    """Stands in for a module until one of its attributes is used; then imports the real one and delegates."""

    _lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        with self._lock:
            if sys.modules.get(self.__name__) is self:
                del sys.modules[self.__name__]
            real = importlib.import_module(self.__name__)
        return getattr(real, name)


def _defer_invoke() -> None:
    """Import `invoke` on first use instead of at paramiko's import.

    paramiko 5 (which depends on invoke) imports it at the top of paramiko/config.py only to run an
    ssh_config `Match exec` line; importing it and the unittest.mock it pulls in was ~5% of every verb's
    start. The stand-in keeps `Match exec` working: its first `invoke.run` imports the real package.
    """
    if "invoke" in sys.modules:
        return
    try:
        spec = importlib.util.find_spec("invoke")
    except (ImportError, ValueError):
        return
    if spec is None:
        return  # not installed: paramiko records the ImportError as it always did
    stand_in = _Deferred("invoke")
    stand_in.__spec__ = spec
    sys.modules["invoke"] = stand_in


_defer_invoke()


_DIST_NAME = re.compile(r"[-_.]+")


class _Metadata(_Deferred):
    """`importlib.metadata` until more than an installed distribution's version is asked of it."""

    def version(self, distribution_name: str) -> str:
        found = _installed_version(distribution_name)
        return found if found is not None else str(self.__getattr__("version")(distribution_name))

    def entry_points(self, **params: Any) -> Any:
        return self.__getattr__("entry_points")(**params)


def _installed_version(name: str) -> str | None:
    """The version in the name of the first `<name>-<version>.dist-info` folder on sys.path (as
    importlib.metadata would find it), or None when there is none."""
    wanted = _DIST_NAME.sub("-", name).lower()
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for folder in names:
            if folder.endswith(".dist-info"):
                stem, _, version = folder[: -len(".dist-info")].rpartition("-")
                if stem and _DIST_NAME.sub("-", stem).lower() == wanted:
                    return version
    return None


def defer_metadata() -> Callable[[], None]:
    """Keep `importlib.metadata` out of the CLI's start; returns what undoes the pydantic half of it.

    paramiko 5 reads its own version with `importlib.metadata.version` at import, and pydantic looks for
    plugins through `entry_points` when the inventory's models are built: importing importlib.metadata (email,
    zipfile, csv, …) and scanning every installed distribution was ~10% of `status`'s CPU on a 2-core host.
    A stand-in answers `version` from the dist-info folder's name (as importlib.metadata reads it) and imports
    the real module for anything else; pydantic plugins are off while the CLI's own models are built (no
    plugin is meant to see the inventory), unless the user set PYDANTIC_DISABLE_PLUGINS themselves.
    """
    if "importlib.metadata" not in sys.modules:
        spec = importlib.util.find_spec("importlib.metadata")
        if spec is not None and spec.submodule_search_locations is not None:
            stand_in = _Metadata("importlib.metadata")
            stand_in.__spec__ = spec
            stand_in.__path__ = list(spec.submodule_search_locations)  # a package: `from … import` asks for it
            sys.modules["importlib.metadata"] = stand_in
    if "PYDANTIC_DISABLE_PLUGINS" in os.environ:
        return lambda: None
    os.environ["PYDANTIC_DISABLE_PLUGINS"] = "__all__"

    def undo() -> None:
        os.environ.pop("PYDANTIC_DISABLE_PLUGINS", None)

    return undo
