"""Getting the node image onto the hosts that lack it: stream it from this machine over SSH, or pull it.

Streaming is how air-gapped fleets get images: `docker save` here, compressed once into a cached archive
(zstd when this machine and every receiving host have it, else gzip), then sent over each host's SSH
connection into `docker load`, several hosts at a time. Compressing once instead of once per host keeps
the operator's CPU free for the transfers and gives exact per-host progress (bytes sent of the archive).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from .archive import Step, save_compressed
from .checks import CheckResult, Status
from .checks.catalog import IMAGE_ID_CHECK
from .errors import OperationError
from .inventory import Inventory
from .progress import Progress, TransferProgress, quiet
from .transport import Transport, quote
from .transport.fanout import fanout
from .transport.pool import Connect

STREAM_PARALLEL = 4  # hosts receiving the image at once (the operator's uplink is the shared resource)
IMAGE_CHECKS = (IMAGE_ID_CHECK, "image-same")
_CODECS = {"zstd": (["zstd", "-q", "-T0", "-3", "-c"], "zstd -dc"), "gzip": (["gzip", "-1", "-c"], "gzip -dc")}


@dataclass(frozen=True)
class ImageTransfer:
    """What `up` did (or has to do) about the image on one host."""

    host: str
    reason: str  # "missing" / "different image ID …"
    method: str  # "stream" / "pull"
    seconds: float = 0.0
    bytes_sent: int = 0
    codec: str = ""

    def to_dict(self) -> dict[str, object]:
        return {
            "host": self.host,
            "reason": self.reason,
            "method": self.method,
            "seconds": round(self.seconds, 2),
            "bytes_sent": self.bytes_sent,
            "codec": self.codec,
        }


def docker_here() -> str | None:
    return shutil.which("docker")


def local_image_id(image: str) -> str | None:
    """The image's ID in this machine's Docker engine, or None (no Docker here, or no such image)."""
    docker = docker_here()
    if docker is None:
        return None
    done = subprocess.run([docker, "image", "inspect", "--format", "{{.Id}}", image], capture_output=True, text=True)
    image_id = done.stdout.strip()
    return image_id if done.returncode == 0 and image_id.startswith("sha256:") else None


def remote_image_ids(results: list[CheckResult]) -> dict[str, str | None]:
    """Each host's image ID as the `image` check found it (None: the host lacks the image)."""
    ids: dict[str, str | None] = {}
    for result in results:
        if result.id == IMAGE_ID_CHECK and result.status != Status.SKIP:  # SKIP: not checked (unreachable)
            ids[result.host] = result.data.get("image_id") if result.status == Status.OK else None
    return ids


def plan_transfers(
    inventory: Inventory, local_id: str | None, remote_ids: dict[str, str | None]
) -> list[ImageTransfer]:
    """The hosts whose image is missing, or differs from this machine's (pure).

    Raises when a host needs the image, streaming is asked for, and this machine does not have it.
    """
    method = inventory.image_source
    # Pulling: the registry is the reference, so pull where missing and, when the hosts disagree, everywhere
    # (a pull of an up-to-date image is a no-op). Streaming: this machine's image is the reference.
    present = {i for i in remote_ids.values() if i is not None}
    reference = local_id if method == "stream" else (None if len(present) > 1 else next(iter(present), None))
    plan = []
    for host in inventory.hosts:
        address = str(host.address)
        if address not in remote_ids:
            continue  # not checked (unreachable): the ssh check already fails
        remote = remote_ids[address]
        if remote is None:
            plan.append(ImageTransfer(address, "missing", method))
        elif method == "pull" and reference is None:
            plan.append(ImageTransfer(address, "hosts have different image IDs", method))
        elif method == "stream" and reference is not None and remote != reference:
            plan.append(ImageTransfer(address, f"different image ID {remote[7:19]} (here: {reference[7:19]})", method))
    if plan and method == "stream" and local_id is None:
        hosts = ", ".join(t.host for t in plan)
        raise OperationError(
            f"image {inventory.image} is missing on {hosts} and not in this machine's Docker engine to stream from",
            f"build or load {inventory.image} here (then `up` streams it over SSH), "
            "or set image_source: pull in the inventory if the hosts can reach a registry",
        )
    return plan


def demote_fixed_checks(results: list[CheckResult], plan: list[ImageTransfer]) -> list[CheckResult]:
    """Image checks that `up` is about to fix become warnings saying so (pure).

    `image` failures on the planned hosts, and `image-same` everywhere when every differing host is in the
    plan (afterwards all hosts have this machine's image).
    """
    fixing = {t.host for t in plan}
    if not fixing:
        return results
    planned_all = all(r.host in fixing or r.status == Status.OK for r in results if r.id == IMAGE_ID_CHECK)
    out = []
    for result in results:
        fixed = result.status == Status.FAIL and (
            (result.id == IMAGE_ID_CHECK and result.host in fixing) or (result.id == "image-same" and planned_all)
        )
        if fixed:
            verb = "streams" if plan[0].method == "stream" else "pulls"
            result = CheckResult(
                result.id, result.host, Status.WARN, f"{result.message} (up {verb} it)", result.hint, result.data
            )
        out.append(result)
    return out


def distribute(
    inventory: Inventory,
    connect: Connect,
    plan: list[ImageTransfer],
    local_id: str | None,
    archive_dir: Path,
    progress: Progress = quiet,
) -> list[ImageTransfer]:
    """Carry out `plan`: every listed host gets the image, STREAM_PARALLEL at a time; raise naming each failure."""
    if not plan:
        return []
    host_of = {str(h.address): h for h in inventory.hosts}
    what = f"receive the image {inventory.image}"
    if plan[0].method == "pull":
        outcomes = fanout(plan, lambda t: _pull(connect(host_of[t.host]), inventory.image, t, progress), what=what)
    else:
        assert local_id is not None
        transports = {t.host: connect(host_of[t.host]) for t in plan}
        codec = _codec([transports[t.host] for t in plan])
        archive = _archive(inventory.image, local_id, codec, archive_dir, progress)
        outcomes = fanout(
            plan,
            lambda t: _stream(transports[t.host], inventory.image, local_id, archive, codec, t, progress),
            max_workers=STREAM_PARALLEL,
            what=what,
        )
    outcomes.raise_failures()
    return outcomes.values()


def _codec(transports: list[Transport]) -> str:
    """zstd when this machine and every receiving host have it, else gzip (everyone has gzip)."""
    if shutil.which("zstd") is None:
        return "gzip"
    have = fanout(transports, lambda t: t.run("command -v zstd", timeout=30).ok, what="look for zstd")
    have.raise_failures()
    return "zstd" if all(have.values()) else "gzip"


def _archive(image: str, image_id: str, codec: str, archive_dir: Path, progress: Progress) -> Path:
    """`docker save | compress` into archive_dir once per image ID and codec (older archives removed)."""
    suffix = "tar.zst" if codec == "zstd" else "tar.gz"
    path = archive_dir / f"{image_id[7:19]}.{suffix}"
    if path.exists():
        return path
    archive_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    for old in archive_dir.glob("*.tar.*"):
        old.unlink()
    docker = docker_here()
    assert docker is not None
    size = subprocess.run(
        [docker, "image", "inspect", "--format", "{{.Size}}", image], capture_output=True, text=True
    ).stdout.strip()
    total = int(size) if size.isdigit() else 0
    ensure_room(archive_dir, total, f"the compressed archive of {image}")
    progress(f"saving {image} ({image_id[7:19]}) and compressing it with {codec}")
    label = f"docker save | {codec} (here)"
    done = save_compressed(
        Step([docker, "save", image], "docker save"),
        Step(_CODECS[codec][0], codec),
        path,
        lambda n: progress(TransferProgress("(compress)", n, max(total, n), label=label)),
        what=f"the archive of {image}",
    )
    progress(TransferProgress("(compress)", done, done, done=True, label=label))
    return path


def ensure_room(directory: Path, needed: int, what: str) -> None:
    """Refuse before writing ``needed`` bytes into ``directory`` when its file system has less free.

    For an image archive ``needed`` is the image's uncompressed size, a safe upper bound of the archive
    (about half of it for a node image): a multi-GB save that fills the disk would fail only minutes later.
    """
    free = psutil.disk_usage(str(directory)).free
    if needed > free:
        raise OperationError(
            f"{directory} has {_gib(free)} free; {what} needs up to {_gib(needed)}",
            "free space there, or move raycluster's state dir to a larger disk (RAYCLUSTER_STATE_DIR=DIR)",
        )


def _gib(count: int) -> str:
    return f"{count / 2**30:.1f} GiB"


def _stream(
    transport: Transport,
    image: str,
    image_id: str,
    archive: Path,
    codec: str,
    transfer: ImageTransfer,
    progress: Progress,
) -> ImageTransfer:
    started = time.monotonic()
    total = archive.stat().st_size
    sent = 0
    progress(TransferProgress(transfer.host, 0, total))

    def on_sent(count: int) -> None:
        nonlocal sent
        sent += count
        progress(TransferProgress(transfer.host, sent, total))

    with archive.open("rb") as source:
        result = transport.feed(f"{_CODECS[codec][1]} | docker load -q", source, on_sent=on_sent, timeout=1800)
    progress(TransferProgress(transfer.host, sent, total, done=True))
    if not result.ok:
        raise OperationError(
            f"{transfer.host}: docker load failed: {result.first_line()}",
            f"check free disk space on {transfer.host} (df -h /var/lib/docker) and retry `raycluster up`",
        )
    _verify(transport, image, image_id, transfer.host)
    return ImageTransfer(transfer.host, transfer.reason, "stream", time.monotonic() - started, sent, codec)


def _pull(transport: Transport, image: str, transfer: ImageTransfer, progress: Progress) -> ImageTransfer:
    started = time.monotonic()
    progress(f"{transfer.host}: docker pull {image} ({transfer.reason})")
    result = transport.run("docker pull -q " + quote(image), timeout=1800)
    if not result.ok:
        raise OperationError(
            f"{transfer.host}: docker pull {image} failed: {result.first_line()}",
            "check that the host reaches the registry and is logged in, or set image_source: stream",
        )
    return ImageTransfer(transfer.host, transfer.reason, "pull", time.monotonic() - started)


def _verify(transport: Transport, image: str, image_id: str, host: str) -> None:
    found = transport.run("docker image inspect --format '{{.Id}}' " + quote(image)).stdout.strip()
    if found != image_id:
        raise OperationError(
            f"{host}: after docker load, {image} is {found[7:19] or 'missing'}, expected {image_id[7:19]}",
            "the image may have been re-tagged meanwhile: re-run `raycluster up`",
        )
