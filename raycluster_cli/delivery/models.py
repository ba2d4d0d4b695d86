"""A model folder on the hosts: content-addressed, verified whole before it is used, sent only where it is missing.

A checkpoint folder on the operator's machine (Hugging Face layout: config.json, *.safetensors, tokenizer files)
is named by a digest of its manifest (each file's path, size and SHA-256), so the same files are the same model
wherever they are and a changed file is a new model. Each host keeps models in its cluster folder
(`<host state dir>/<cluster>/models/<digest>/`, host/folders.py), which `up` mounts read-only into every Ray
container at MODELS_IN_CONTAINER: bench and serve read `/run/raycluster/models/<digest>` on every node.

What travels is one uncompressed tar of the files with the manifest last, written the same way every time
(fixed headers, no times or owners), so its size and SHA-256 are known from the one pass that hashes the files
and the relay (delivery/relay.py) carries it like the image archive: one upload, then host to host, each host's
copy verified whole (the tar's SHA-256) before it is unpacked. The unpack (`use_command`) goes into a private
folder beside the cache, checks every file against the manifest again (a file that differs, is missing or is
extra stops it), makes the files read-only and only then renames the folder to its digest, so a model folder
that exists is whole and verified; a broken or interrupted copy leaves nothing under that name. A host that
has the model is not sent a byte.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.errors import UsageError
from raycluster_cli.host.containers import MODELS_IN_CONTAINER
from raycluster_cli.host.folders import models_dir
from raycluster_cli.transport import quote, shell_path

MANIFEST = ".raycluster-manifest"
ABOUT = ".raycluster-model"  # in a stored model's folder: its name and bytes, tab-separated (for `status`)
RECEIVED = "raycluster: model received and verified"
_CHUNK = 1 << 20
_BLOCK = 512


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
    tar_size: int = 0  # the bytes of its tar (tar_chunks), what the relay carries
    tar_sha256: str = ""  # their SHA-256 (hex)

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
    whole = hashlib.sha256()  # the tar's, fed as tar_chunks would write it: one read of each file
    size = 0
    for file in sorted(_walk(root)):
        relative = file.relative_to(root).as_posix()
        if any(c in relative for c in "\n\\"):
            raise UsageError(f"--model-path: {relative!r} has a newline or backslash in its name", "rename the file")
        length = file.stat().st_size
        header = _header(relative, length)
        whole.update(header)
        digest = hashlib.sha256()
        read = 0
        with file.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
                whole.update(chunk)
                read += len(chunk)
        if read != length:
            raise UsageError(f"--model-path: {relative} changed while it was read", "run again once it is written")
        whole.update(_padding(length))
        size += len(header) + length + len(_padding(length))
        files.append(ModelFile(relative, length, digest.hexdigest()))
    folder = ModelFolder(root, tuple(files))
    for chunk in _tail(folder):
        whole.update(chunk)
        size += len(chunk)
    return ModelFolder(root, folder.files, size, whole.hexdigest())


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


def _header(path: str, size: int) -> bytes:
    """A tar member's header, the same for the same path and size (no time, owner or mode of this machine's)."""
    info = tarfile.TarInfo(path)
    info.size, info.mode, info.mtime = size, 0o644, 0
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _padding(size: int) -> bytes:
    return b"\0" * (-size % _BLOCK)


def _tail(model: ModelFolder) -> Iterator[bytes]:
    """The manifest (last, so the files' digests are known by then) and the end-of-archive blocks."""
    manifest = model.manifest.encode()
    yield _header(MANIFEST, len(manifest))
    yield manifest + _padding(len(manifest))
    yield b"\0" * (2 * _BLOCK)


def tar_chunks(model: ModelFolder, files: tuple[ModelFile, ...] | None = None) -> Generator[bytes, None, None]:
    """The model's tar, as read_model_folder hashed it: each file (or only `files`, what a host lacks), then the
    whole manifest. Raises when a file's size changed since (its SHA-256 would not match the receivers' anyway)."""
    for file in model.files if files is None else files:
        yield _header(file.path, file.size)
        sent = 0
        with (model.root / file.path).open("rb") as handle:
            while sent < file.size and (chunk := handle.read(min(_CHUNK, file.size - sent))):
                sent += len(chunk)
                yield chunk
        if sent != file.size:
            raise OSError(f"{model.root / file.path} changed while it was sent")
        yield _padding(file.size)
    yield from _tail(model)


class TarReader(io.RawIOBase):
    """tar_chunks as a raw binary file (what transport.feed reads, through `open_tar`)."""

    def __init__(self, model: ModelFolder, files: tuple[ModelFile, ...] | None = None) -> None:
        super().__init__()
        self._chunks = tar_chunks(model, files)
        self._left = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._left:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._left = chunk
        view = memoryview(buffer).cast("B")
        count = min(len(view), len(self._left))
        view[:count] = self._left[:count]
        self._left = self._left[count:]
        return count

    def close(self) -> None:
        self._chunks.close()
        super().close()


def open_tar(model: ModelFolder, files: tuple[ModelFile, ...] | None = None) -> io.BufferedReader:
    """The model's tar (or the part of it with only `files`), to read from the start (no copy of it on this
    machine's disk)."""
    return io.BufferedReader(TarReader(model, files), _CHUNK)


@dataclass(frozen=True)
class HeldModel:
    """A model a host holds: its digest, its files' bytes and its folder's name when it was sent (else "")."""

    digest: str
    size: int | None
    name: str

    def to_dict(self) -> dict[str, object]:
        return {"digest": self.digest, "size": self.size, "name": self.name}


def held_command(inventory: Inventory, host: HostConfig) -> str:
    """Prints each whole model the host holds, one a line: digest, bytes and name, tab-separated ("-" unknown)."""
    folder = shell_path(models_dir(inventory, host))
    return (
        f'for m in {folder}/*/{MANIFEST}; do [ -f "$m" ] || continue; d=${{m%/*}}; n=; s=; '
        f'[ -f "$d/{ABOUT}" ] && IFS="$(printf \'\\t\')" read -r n s <"$d/{ABOUT}"; '
        'printf "%s\\t%s\\t%s\\n" "${d##*/}" "${s:--}" "${n:--}"; done; true'
    )


def parse_models(text: str) -> list[HeldModel]:
    """held_command's output (pure); lines that are not a model's are left out."""
    held = []
    for line in text.splitlines():
        digest, _, rest = line.strip("\r").partition("\t")
        size, _, name = rest.partition("\t")
        if len(digest) == 32 and all(c in "0123456789abcdef" for c in digest):
            held.append(HeldModel(digest, int(size) if size.isdigit() else None, "" if name == "-" else name))
    return held


def parse_held(text: str) -> set[str]:
    return {m.digest for m in parse_models(text)}


def use_command(inventory: Inventory, host: HostConfig, model: ModelFolder) -> str:
    """Shell text run by the relay's receive script once the tar ("$a") is verified whole (its `_sha` defined):
    unpack it into a private folder, add each file the tar left out (the host holds it in another model: a hard
    link to that read-only file, else a copy; the old model is never written to), check every file against the
    manifest (and no file it does not list), note the name and size, make it read-only and rename it to the
    digest; on any failure remove it (its folders made writable, never its files: some are another model's).
    Prints RECEIVED when the model is there."""
    folder = shell_path(models_dir(inventory, host))
    digest = model.digest
    name = "".join(" " if c in "\t\r\n" else c for c in model.root.name)
    about = quote(f"{name}\t{model.size}")
    writable_folders = 'find "$d" -type d -exec chmod u+w {} + 2>/dev/null'
    return (
        f'models={folder}; [ -d "${{models%/*}}" ] || {{ echo "no cluster folder ${{models%/*}}: run raycluster up first" >&2; '
        'exit 1; }; [ -d "$models" ] || (umask 022 && mkdir -- "$models") || exit 1; incoming=$(mktemp -d "$models/.incoming-XXXXXX") || exit 1; '
        f'trap \'d=$incoming; {writable_folders}; rm -rf -- "$incoming"; rm -f -- "$p" "$f"\' EXIT; '
        'tar -x --no-same-owner --no-same-permissions -C "$incoming" -f "$a" || exit 1; cd "$incoming" || exit 1; '
        'while IFS= read -r line; do sum=${line%%  *}; path=${line#*  }; [ -e "$path" ] && continue; '
        'case "$path" in */*) mkdir -p -- "${path%/*}" || exit 1;; esac; '
        f'for m in "$models"/*/{MANIFEST}; do hit=$(grep -m1 -e "^$sum  " -- "$m" 2>/dev/null) || continue; '
        'src=${m%/*}/${hit#*  }; { ln -- "$src" "$path" 2>/dev/null || cp -- "$src" "$path"; } && break; done; '
        '[ -e "$path" ] || { echo "$path neither arrived nor is in a model this host holds" >&2; exit 1; }; '
        f"done <{MANIFEST}; "
        "while IFS= read -r line; do sum=${line%%  *}; path=${line#*  }; "
        '[ "$(_sha "$path")" = "$sum" ] || { echo "$path does not match the manifest" >&2; exit 1; }; '
        f"done <{MANIFEST}; "
        f"listed=$(cut -c67- {MANIFEST} | sort); present=$(find . -type f ! -name {MANIFEST} | cut -c3- | sort); "
        '[ "$listed" = "$present" ] || { echo "files that the manifest does not list arrived" >&2; exit 1; }; '
        f"printf '%s\\n' {about} >{ABOUT}; "
        'cd / && chmod -R a-w,a+rX "$incoming" && chmod u+w "$incoming" || exit 1; '
        f'if [ ! -f "$models/{digest}/{MANIFEST}" ]; then d="$models/{digest}"; {writable_folders}; '
        f'rm -rf -- "$models/{digest}"; mv -- "$incoming" "$models/{digest}" && chmod u-w "$models/{digest}" || exit 1; fi; '
        f"echo {quote(RECEIVED)}"
    )
