"""What the inventory may not say because raycluster says it itself, and bounds on values that would only fail
later on a host (issue 34, items 1 and 14). Pure: names and numbers, no I/O."""

from __future__ import annotations

# Ray's token authentication reads these from the environment; `up` sets RAY_AUTH_MODE and RAY_AUTH_TOKEN_PATH on
# the container, and the inventory's `env` file is sourced after them, so a value there would win (auth off while
# `up` reports `auth: token`). Every RAY_AUTH_* name is refused, in any case: Ray may read more of them.
OWNED_ENV_PREFIXES = ("RAY_AUTH_",)


def owned_env_problem(name: str) -> str | None:
    """Why `name` may not be set through `env`, or None."""
    if name.upper().startswith(OWNED_ENV_PREFIXES):
        return f"raycluster sets {name} itself from ray.auth (Ray's token authentication); env may not change it"
    return None


OWNED_ENV_HINT = "remove it from env; use ray.auth: token (default) or ray.auth: none to choose Ray's authentication"


# Bounds on values that would only fail later, on a host or in Ray (item 14).
MIN_WAIT_S = 0.1  # a connect, keepalive or stall deadline shorter than this cannot be met
MAX_CPUS = 1_000_000  # `ray start --num-cpus` of a node
MAX_GPUS = 10_000


def nul_problem(value: str) -> str | None:
    """A NUL byte cannot be in a path or an environment value (the OS cuts there, or refuses it)."""
    return "contains a NUL byte (\\0), which no path or environment value can hold" if "\0" in value else None


NUL_HINT = "remove the \\0 escape from the value"
