"""Getting the node image onto the hosts that lack it: stream it from this machine over SSH, or pull it.

Streaming is how air-gapped fleets get images: `docker save` here, compressed once with all cores into a
cached archive (zstd -T0 when this machine and every receiving host have it, else pigz or gzip), sent over
one seed host's SSH connection; from there the hosts that have it serve the hosts that lack it (delivery/relay.py,
schedule.py, peer_copy.py), so this machine uploads about one copy whatever the fleet's size. Each host loads
the archive only once its SHA-256 is this machine's (delivery/receive.py), and the loaded ID must be this
machine's image ID.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import psutil

from raycluster_cli.config.inventory import Inventory
from raycluster_cli.delivery.archive import Step, save_compressed
from raycluster_cli.delivery.relay import relay
from raycluster_cli.delivery.schedule import ImageTransfer, Job, Receiver
from raycluster_cli.errors import OperationError
from raycluster_cli.host.engine import image_id as image_id_of
from raycluster_cli.progress import Progress, TransferProgress, quiet
from raycluster_cli.transport import CommandResult, Transport, quote
from raycluster_cli.transport.fanout import GroupResult, Outcome, fanout
from raycluster_cli.transport.pool import Connect


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


def distribute(
    inventory: Inventory,
    connect: Connect,
    plan: list[ImageTransfer],
    local_id: str | None,
    archive_dir: Path,
    progress: Progress = quiet,
) -> list[ImageTransfer]:
    """Carry out `plan`: every listed host gets the image; raise naming each failure.

    Streaming: the operator sends the archive to one seed host; from then on every host that has it serves
    one that lacks it (host to host, see peer_copy.py), so the copies double each round and the operator's
    upload stays one copy. A host that cannot get it from a peer gets it from the operator.
    """
    if not plan:
        return []
    host_of = {str(h.address): h for h in inventory.hosts}
    what = f"receive the image {inventory.image}"
    if plan[0].method == "pull":
        outcomes = fanout(plan, lambda t: _pull(connect(host_of[t.host]), inventory.image, t, progress), what=what)
    else:
        assert local_id is not None
        outcomes = GroupResult(_spread(inventory, connect, plan, local_id, archive_dir, progress), what)
    outcomes.raise_failures()
    return outcomes.values()


def _spread(
    inventory: Inventory,
    connect: Connect,
    plan: list[ImageTransfer],
    image_id: str,
    archive_dir: Path,
    progress: Progress,
) -> list[tuple[ImageTransfer, Outcome[ImageTransfer]]]:
    """Stream: compress once (the codec every receiving host can read), then relay it (delivery/relay.py)."""

    def make_job(tools: list[frozenset[str]]) -> Job:
        here = {tool for tool in ("zstd", "pigz") if shutil.which(tool)}
        codec = choose_codec(here, tools)
        archive = _archive(inventory.image, image_id, codec, archive_dir, progress)
        return image_job(inventory.image, image_id, archive, codec, archive_digest(archive))

    return relay(inventory, connect, plan, make_job, progress)


def image_job(image: str, image_id: str, archive: Path, codec: str, digest: str) -> Job:
    """The node image as the relay carries it: its compressed archive, loaded once verified; the loaded ID must be
    this machine's."""

    def use(receiver: Receiver) -> str:
        return (
            f'{decompressor(codec, receiver.tools)} <"$a" | docker load -q >&2 && '
            f"docker image inspect --format '{{{{.Id}}}}' {quote(image)}"
        )

    def verify(receiver: Receiver, result: CommandResult) -> None:
        lines = result.stdout.strip().splitlines()
        found = image_id_of(lines[-1]) if lines else ""
        if found != image_id:
            raise OperationError(
                f"{receiver.host}: after docker load, {image} is {found[7:19] or 'missing'}, expected {image_id[7:19]}",
                "the image may have been re-tagged meanwhile: re-run `raycluster up`",
            )

    suffix = archive.name.split(".", 1)[1]
    return Job(
        what=f"image {image}",
        name=f"{image_id[7:19]}.{suffix}",
        size=archive.stat().st_size,
        digest=digest,
        open=lambda: archive.open("rb"),
        use=use,
        verify=verify,
        listener_image=image,
        codec=codec,
    )


def choose_codec(here: set[str], hosts: list[frozenset[str]]) -> str:
    """zstd when this machine and every receiving host have it, else gzip (everyone has gzip) (pure)."""
    return "zstd" if "zstd" in here and all("zstd" in tools for tools in hosts) else "gzip"


def compressor(codec: str) -> list[str]:
    """The compressor here, with all cores: zstd -T0, else pigz, else gzip (all write what gzip -d reads)."""
    if codec == "zstd":
        return ["zstd", "-q", "-T0", "-3", "-c"]
    return ["pigz", "-1", "-c"] if shutil.which("pigz") else ["gzip", "-1", "-c"]


def decompressor(codec: str, tools: frozenset[str]) -> str:
    if codec == "zstd":
        return "zstd -dc"
    return "pigz -dc" if "pigz" in tools else "gzip -dc"


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
    label = f"docker save | {compressor(codec)[0]} (here)"
    done = save_compressed(
        Step([docker, "save", image], "docker save"),
        Step(compressor(codec), codec),
        path,
        lambda n: progress(TransferProgress("(compress)", n, max(total, n), label=label)),
        what=f"the archive of {image}",
    )
    progress(TransferProgress("(compress)", done, done, done=True, label=label))
    return path


def archive_digest(archive: Path) -> str:
    """The archive's SHA-256 (hex), computed once and kept beside it (`<archive>.sha256`, made with the
    archive's own rights); a kept digest older than the archive is computed again."""
    kept = archive.with_name(archive.name + ".sha256")
    with contextlib.suppress(OSError):
        if kept.stat().st_mtime >= archive.stat().st_mtime:
            text = kept.read_text().strip()
            if len(text) == 64 and all(c in "0123456789abcdef" for c in text):
                return text
    with archive.open("rb") as source:
        digest = hashlib.file_digest(source, "sha256").hexdigest()
    with contextlib.suppress(OSError):
        partial = kept.with_name(kept.name + ".partial")
        partial.write_text(digest + "\n")
        os.replace(partial, kept)
    return digest


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
