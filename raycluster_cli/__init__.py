"""raycluster: a Ray cluster in Docker on your own machines, checked first and proven balanced."""

import importlib
import importlib.util
import sys
import threading
import types
from typing import Any

__version__ = "0.1.0"


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
