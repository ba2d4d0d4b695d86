"""A model folder onto the hosts: content-addressed, verified whole on arrival, sent only where it is missing.

A checkpoint folder on the operator's machine (Hugging Face layout: config.json, *.safetensors, tokenizer files)
is named by a digest of its manifest (each file's path, size and SHA-256), so the same files are the same model
wherever they are and a changed file is a new model. Each host keeps models in its cluster folder
(`<host state dir>/<cluster>/models/<digest>/`, host/folders.py), which `up` mounts read-only into every Ray
container at MODELS_IN_CONTAINER: bench and serve read `/run/raycluster/models/<digest>` on every node.

A host that lacks a model gets it as one tar stream over its own SSH connection. The receiver unpacks into a
private folder beside the cache, checks every file against the manifest with `sha256sum -c` (a file that differs,
is missing or is extra stops it), makes the files read-only and only then renames the folder to its digest, so a
model folder that exists is whole and verified; a broken or interrupted copy leaves nothing under that name. A
host that has the model is not sent a byte. (Today the operator sends each host that lacks the model its own copy;
the host-to-host relay `up` uses for images, one upload then hosts serve each other, is the next step.)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tarfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.errors import OperationError, UsageError
from raycluster_cli.host.containers import MODELS_IN_CONTAINER
from raycluster_cli.host.folders import models_dir
from raycluster_cli.transport import Transport, quote, shell_path

MANIFEST = ".raycluster-manifest"
RECEIVED = "raycluster: model received and verified"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ModelFile:
    path: str  # relative, with forward slashes
    size: int
    sha256: str


@dataclass(frozen=True)
class ModelFolder:
    """A checkpoint folder on this machine and what names it: its files' digests."""

    root: Path
    files: tuple[ModelFile, ...]

    @property
    def manifest(self) -> str:
        """`sha256sum -c` input: one `HASH  PATH` line per file, sorted by path."""
        return "".join(f"{f.sha256}  {f.path}\n" for f in self.files)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.manifest.encode()).hexdigest()[:32]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def in_container(self) -> str:
        return f"{MODELS_IN_CONTAINER}/{self.digest}"


def read_model_folder(path: str | os.PathLike[str]) -> ModelFolder:
    """Hash every file of the folder (regular files only; links that stay inside it are followed).

    Refuses a folder without config.json (or a diffusers model_index.json), links that lead out of it, and anything
    that is not a file."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise UsageError(f"--model-path {path}: no such folder on this machine", "give a checkpoint folder")
    if not (root / "config.json").is_file() and not (root / "model_index.json").is_file():
        raise UsageError(
            f"--model-path {path}: no config.json (or diffusers model_index.json) there",
            "give a Hugging Face checkpoint folder (config.json, weights)",
        )
    files = []
    for file in sorted(_walk(root)):
        relative = file.relative_to(root).as_posix()
        if any(c in relative for c in "\n\\"):
            raise UsageError(f"--model-path: {relative!r} has a newline or backslash in its name", "rename the file")
        files.append(ModelFile(relative, file.stat().st_size, _sha256(file)))
    return ModelFolder(root, tuple(files))


def _walk(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith("."):
                continue
            file = Path(dirpath) / name
            real = file.resolve()
            if not real.is_relative_to(root) or not real.is_file():
                raise UsageError(
                    f"--model-path: {file} is not a file inside {root}", "copy the file into the folder instead"
                )
            yield file


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def held_command(inventory: Inventory, host: HostConfig) -> str:
    """Prints the digest of each whole model the host holds, one a line (nothing when the cache is empty)."""
    folder = shell_path(models_dir(inventory, host))
    return f'for m in {folder}/*/{MANIFEST}; do [ -f "$m" ] && basename "$(dirname "$m")"; done; true'


def parse_held(text: str) -> set[str]:
    return {line.strip() for line in text.splitlines() if len(line.strip()) == 32}


def receive_command(inventory: Inventory, host: HostConfig, digest: str) -> str:
    """Unpack a tar stream from stdin into a private folder, verify every file against the manifest in it, make
    it read-only and rename it to the digest; on any failure remove it. Prints RECEIVED when the model is there."""
    folder = shell_path(models_dir(inventory, host))
    return (
        f'set -e; models={folder}; mkdir -p "$models"; incoming="$models/.incoming-$$"; '
        'rm -rf -- "$incoming"; mkdir -m 700 -- "$incoming"; trap \'chmod -R u+w "$incoming" 2>/dev/null; '
        'rm -rf -- "$incoming"\' EXIT; '
        'tar -x --no-same-owner --no-same-permissions -C "$incoming" -f -; '
        f'cd "$incoming"; sha256sum --quiet --strict -c {MANIFEST} >&2; '
        f"listed=$(cut -c67- {MANIFEST} | sort); present=$(find . -type f ! -name {MANIFEST} | cut -c3- | sort); "
        '[ "$listed" = "$present" ] || { echo "files that the manifest does not list arrived" >&2; exit 1; }; '
        f'cd /; chmod -R a-w,a+rX "$incoming"; chmod u+w "$incoming"; '
        f'if [ -f "$models/{digest}/{MANIFEST}" ]; then :; else chmod -R u+w "$models/{digest}" 2>/dev/null || true; '
        f'rm -rf -- "$models/{digest}"; mv -- "$incoming" "$models/{digest}"; chmod u-w "$models/{digest}"; fi; '
        f'trap - EXIT; if [ -e "$incoming" ]; then chmod -R u+w "$incoming"; rm -rf -- "$incoming"; fi; '
        f"echo {quote(RECEIVED)}"
    )


def tar_stream(model: ModelFolder) -> tuple[BinaryIO, threading.Thread]:
    """The model's files and its manifest as an uncompressed tar (weights do not compress), written by a thread
    into a pipe: the stream's size is the model's, nothing is staged on this machine's disk."""
    read_fd, write_fd = os.pipe()
    reader = os.fdopen(read_fd, "rb")

    def write() -> None:
        with os.fdopen(write_fd, "wb") as out, tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            manifest = model.manifest.encode()
            info = tarfile.TarInfo(MANIFEST)
            info.size, info.mode = len(manifest), 0o644
            tar.addfile(info, _BytesReader(manifest))
            for file in model.files:
                info = tarfile.TarInfo(file.path)
                info.size, info.mode = file.size, 0o644
                with (model.root / file.path).open("rb") as handle:
                    tar.addfile(info, handle)

    thread = threading.Thread(target=_quietly(write), daemon=True, name="model-tar")
    thread.start()
    return reader, thread


class _BytesReader:
    def __init__(self, data: bytes) -> None:
        self.data, self.offset = data, 0

    def read(self, size: int = -1) -> bytes:
        end = len(self.data) if size < 0 else self.offset + size
        chunk, self.offset = self.data[self.offset : end], min(end, len(self.data))
        return chunk


def _quietly(write: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with contextlib.suppress(OSError):  # the receiver stopped reading: its own error says why
            write()

    return run


def send_model(
    transport: Transport,
    inventory: Inventory,
    host: HostConfig,
    model: ModelFolder,
    on_sent: Callable[[int], None] | None = None,
    timeout_s: float = 3600.0,
) -> None:
    """Stream `model` into `host`'s cache and have it verified there; raise naming the host when it is not."""
    source, writer = tar_stream(model)
    try:
        result = transport.feed(
            receive_command(inventory, host, model.digest), source, on_sent=on_sent, timeout=timeout_s
        )
    finally:
        source.close()
        writer.join(timeout=5)
    if not result.ok or RECEIVED not in result.stdout:
        raise OperationError(
            f"{host.address}: the model {model.root.name} ({model.digest[:12]}) was not stored: "
            f"{result.first_line() or f'exit {result.rc}'}",
            f"check free space in {models_dir(inventory, host)} on {host.address}, then run again",
        )
