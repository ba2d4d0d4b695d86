"""The service's front end on the ingress's node: the ingress process and the Ray Serve HTTP proxy beside it.

Every output token costs the head CPU outside the pipeline's stages: the ingress samples it, decodes its text and
hands it to its stream, and Serve's proxy carries each streamed chunk from the ingress to the client.  On a head
that also holds a stage (or on a small head) that CPU is taken from the stage.  ``FrontEndCpu`` reads both
processes' CPU seconds for the service's status, so ``bench --serve`` gives a run's front-end CPU per output
token (on the lab's 1-CPU head: 0.9-1.2 ms in the ingress and 0.5-0.7 ms in the proxy at four streams,
docs/PERFORMANCE.md S25).
"""

from __future__ import annotations

import os
import time
from typing import Any

import psutil

PROXY_TITLE = "ray::ProxyActor"  # the proxy actor's process title (Ray sets it as the command line)


def _is_proxy(process: psutil.Process) -> bool:
    try:
        cmdline = process.cmdline()
    except (psutil.Error, OSError):
        return False
    return bool(cmdline) and cmdline[0].startswith(PROXY_TITLE)


class FrontEndCpu:
    """This process's CPU seconds and the proxy's on this node: the process titled as Ray titles its proxy actor
    among this process's siblings (the node's raylet starts every worker of the node, the proxy and the ingress
    alike; a host that sees other nodes' processes, as the lab's machine does, holds their proxies too), found once
    and found again if it was replaced."""

    def __init__(self, parent: int | None = None) -> None:
        self.parent = os.getppid() if parent is None else parent
        self._proxy: psutil.Process | None = None

    def _find_proxy(self) -> psutil.Process | None:
        if self._proxy is not None and self._proxy.is_running():
            return self._proxy
        try:
            siblings = psutil.Process(self.parent).children()
        except (psutil.Error, OSError):
            siblings = []
        self._proxy = next((p for p in siblings if _is_proxy(p)), None)
        return self._proxy

    def read(self) -> dict[str, Any]:
        """``ingress_pid``, ``ingress_cpu_s`` (every thread of this process, Ray's own included) and the proxy's
        ``proxy_pid``, ``proxy_cpu_s`` (None when no proxy runs on this node, or it cannot be read)."""
        body: dict[str, Any] = {
            "ingress_pid": os.getpid(),
            "ingress_cpu_s": time.process_time(),
            "proxy_pid": None,
            "proxy_cpu_s": None,
        }
        proxy = self._find_proxy()
        if proxy is not None:
            try:
                times = proxy.cpu_times()
                body["proxy_pid"], body["proxy_cpu_s"] = proxy.pid, times.user + times.system
            except (psutil.Error, OSError):
                self._proxy = None
        return body
