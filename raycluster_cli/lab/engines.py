"""The container engine inside the lab's hosts: Docker (dockerd per host) or Podman (Debian's package), and
loading the node image into the hosts through it.

A Podman lab host (`docker/labhost-podman`) is what a Debian machine with `apt-get install podman` is, set up
for rootful Podman inside a Docker container: its storage (overlay) lives on a Docker volume, since overlay
over the host container's own overlay root is refused; cgroups go through cgroupfs (no systemd), events to a
file, and the OCI runtime is runc (crun 1.8 refuses this machine's hybrid cgroup v1/v2 layout).
"""

from __future__ import annotations

import io
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from raycluster_cli.errors import OperationError
from raycluster_cli.host.engine import image_id
from raycluster_cli.progress import Progress, quiet
from raycluster_cli.transport.base import CHUNK

LOAD_TIMEOUT_S = 1800.0  # the deadline of loading the node image into the lab hosts


@dataclass(frozen=True)
class LabEngine:
    name: str  # docker or podman: the program in the host, and docker.engine in the written inventory
    image: str  # the lab host image
    storage: str  # the folder a per-host volume holds (the engine's images and containers)
    # Succeeds once the engine answers; may (re)start a daemon that gave up (see lab._wait_ready).
    ready: str


# The inner dockerd answers; one that gave up starting (on a loaded machine its containerd can miss dockerd's
# own start timeout) is started again, once the entrypoint is done (sshd runs) and no dockerd is left.
_DOCKER_UP = (
    "timeout 10 docker info --format '{{.ServerVersion}}' >/dev/null 2>&1 "
    "|| { pgrep -x sshd >/dev/null && ! pgrep -x dockerd >/dev/null && /usr/local/sbin/labhost-start-dockerd; exit 1; }"
)
DOCKER = LabEngine(
    "docker", os.environ.get("RAYCLUSTER_LAB_IMAGE", "raycluster/labhost:0.1.0"), "/var/lib/docker", _DOCKER_UP
)
PODMAN = LabEngine(
    "podman",
    os.environ.get("RAYCLUSTER_LAB_PODMAN_IMAGE", "raycluster/labhost-podman:0.1.0"),
    "/var/lib/containers",
    "timeout 10 podman info --format '{{.Version.Version}}' >/dev/null 2>&1",
)
ENGINES = {e.name: e for e in (DOCKER, PODMAN)}


def load_image(
    client: Any, containers: list[str], image: str, progress: Progress = quiet, engine: LabEngine = DOCKER
) -> list[str]:
    """Stream `image` from this machine's engine into every lab host that lacks it (or has another image ID):
    one `docker save`, its bytes sent to all of them at once. Returns the hosts that were loaded."""
    import docker

    local = client.images.get(image)
    need = []
    for name in containers:
        found = client.containers.get(name).exec_run([engine.name, "image", "inspect", "--format", "{{.Id}}", image])
        if found.exit_code != 0 or image_id(found.output.decode()) != local.id:
            need.append(name)
    if not need:
        return []
    progress(f"loading {image} into {', '.join(need)}")
    # Saving a multi-GB image can take minutes before its first byte on a loaded machine: a long deadline.
    slow = docker.from_env(version="auto", timeout=LOAD_TIMEOUT_S)
    try:
        results = _exec_with_stdin(slow, need, [engine.name, "load", "-q"], slow.api.get_image(image, chunk_size=CHUNK))
    finally:
        slow.close()
    failed = [(name, out) for name, (code, out) in zip(need, results, strict=True) if code != 0]
    if failed:
        name, output = failed[0]
        raise OperationError(
            f"{name}: loading {image} failed: {output.decode(errors='replace').strip()[:200]}",
            f"check free disk space (df -h {engine.storage}) and retry `raycluster lab up`",
        )
    return need


def _exec_with_stdin(
    client: Any, containers: list[str], command: list[str], chunks: Iterable[bytes]
) -> list[tuple[int, bytes]]:
    """Run `command` in each container with the same `chunks` on its stdin (the engine's exec API, attached
    by socket); each container's exit code and output."""
    from docker.utils.socket import consume_socket_output, demux_adaptor, frames_iter

    execs = [client.api.exec_create(name, command, stdin=True, stdout=True, stderr=True)["Id"] for name in containers]
    socks = [client.api.exec_start(exec_id, socket=True) for exec_id in execs]
    raws = [getattr(sock, "_sock", sock) for sock in socks]  # the SDK hands back a SocketIO around the socket
    results = []
    try:
        for chunk in chunks:
            for raw in raws:
                raw.sendall(chunk)
        for raw in raws:
            raw.shutdown(socket.SHUT_WR)
        for exec_id, sock in zip(execs, socks, strict=True):
            frames = frames_iter(sock, tty=False)
            stdout, stderr = consume_socket_output((demux_adaptor(*f) for f in frames), demux=True)
            exit_code = client.api.exec_inspect(exec_id)["ExitCode"]
            results.append((int(exit_code or 0), (stderr or b"") + (stdout or b"")))
    finally:
        for sock in socks:
            sock.close()
    return results


SMALL_BASE_IMAGE = os.environ.get("BASE_IMAGE", "raycluster/debian-base:bookworm")


def build_small_image(client: Any, tag: str, base: str = SMALL_BASE_IMAGE) -> str:
    """A small image with python3 on this machine's Docker (``client``; tagged ``tag``, its ID returned): the
    cluster image of the fleet tests and benchmarks, whose hosts lack the node image (layers cached)."""
    dockerfile = (
        f"FROM {base}\n"
        "RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends python3-minimal >/dev/null "
        "&& rm -rf /var/lib/apt/lists/*\n"
        "LABEL io.raycluster.test=p2p\n"
    )
    client.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=tag, network_mode="host", rm=True)
    return str(client.images.get(tag).id)
