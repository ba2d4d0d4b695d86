"""What this CPU can do, from the flags Linux lists for it in ``/proc/cpuinfo``: the node runtime's bfloat16 look
(``node.nodes.native_bf16``) and int8's choice of 7 or 8 input bits (``models.int8``) read the same list."""

from __future__ import annotations


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The first ``flags`` line of ``/proc/cpuinfo`` (or of ``cpuinfo``'s text); none when it cannot be read."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as handle:
                cpuinfo = handle.read()
        except OSError:
            return frozenset()
    line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()
