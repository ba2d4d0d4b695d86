"""A throwaway single-node local Ray for tests (no auth, no dashboard), as a context manager."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest


@contextlib.contextmanager
def one_node_ray(**options: Any) -> Iterator[str]:
    """Start a local Ray of one node (``options`` go to ``ray.init`` over the defaults) and yield its node id."""
    import ray

    settings: dict[str, Any] = {
        "address": "local",
        "num_cpus": 2,
        "include_dashboard": False,
        "log_to_driver": False,
        "configure_logging": False,
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        ray.init(**(settings | options))
        try:
            yield ray.get_runtime_context().get_node_id()
        finally:
            ray.shutdown()
