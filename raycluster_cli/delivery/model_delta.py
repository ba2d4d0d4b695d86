"""What each host lacks of a model, file by file: a changed file copies only what changed.

Every model a host holds keeps its manifest (each file's SHA-256 and path, delivery/models.py), so the host's cache
is also a store of file contents: `holdings_command` lists, in one command, the models a host holds and the
SHA-256 of every file in them. A host that holds the model is sent nothing; any other is sent a tar of only the
files whose content it holds in no model (with the whole manifest), and its unpack (models.use_command) adds
the others as hard links to the read-only files it has, then checks every file of the new folder against the
manifest before it is named by its digest. The old model is never written to.

Hosts that lack the same files get the same tar, so they are one relay (one upload, then host to host); after
a change every host usually lacks the same files (one relay of those files), and a host new to the cluster
lacks all of them (a relay of the whole tar, the same bytes as before this module).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.delivery.models import MANIFEST, ModelFile, ModelFolder, held_command, parse_held, tar_chunks
from raycluster_cli.host.folders import models_dir
from raycluster_cli.transport import shell_path

_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Holdings:
    """What one host's cache holds: the models (digests) and the contents of their files (SHA-256s)."""

    models: frozenset[str]
    files: frozenset[str]


@dataclass(frozen=True)
class Shipment:
    """One relay: the files a group of hosts all lack (each sent as the same tar), and those hosts."""

    hosts: tuple[str, ...]
    files: tuple[ModelFile, ...]  # in the model's order
    size: int  # the bytes of their tar
    sha256: str  # its SHA-256 (hex)
    whole: bool  # every file of the model: the model's own tar

    def reused(self, model: ModelFolder) -> int:
        """How many of the model's files each of these hosts adds from what it holds."""
        return len(model.files) - len(self.files)


def holdings_command(inventory: Inventory, host: HostConfig) -> str:
    """The models the host holds (held_command's lines), then the SHA-256 of each of their files, one a line."""
    folder = shell_path(models_dir(inventory, host))
    return f"{held_command(inventory, host)}; cut -c1-64 {folder}/*/{MANIFEST} 2>/dev/null | sort -u; true"


def parse_holdings(text: str) -> Holdings:
    """holdings_command's output (pure): model lines have a 32-hex digest, file lines are a 64-hex SHA-256."""
    files = {line.strip() for line in text.splitlines() if len(line.strip()) == 64 and set(line.strip()) <= _HEX}
    return Holdings(frozenset(parse_held(text)), frozenset(files))


def tar_of(model: ModelFolder, files: tuple[ModelFile, ...]) -> tuple[int, str]:
    """The bytes and SHA-256 of the tar of only `files` (read again from the folder: what a host lacks)."""
    if files == model.files:
        return model.tar_size, model.tar_sha256
    digest, size = hashlib.sha256(), 0
    for chunk in tar_chunks(model, files):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def plan_shipments(model: ModelFolder, held: Mapping[str, Holdings]) -> list[Shipment]:
    """The relays that bring the model to every host in `held` that lacks it (hosts in `held`'s order; the relay
    with the most hosts first). A host is sent each file whose content it holds in no model."""
    groups: dict[tuple[ModelFile, ...], list[str]] = {}
    for host, holdings in held.items():
        if model.digest in holdings.models:
            continue
        lacking = tuple(f for f in model.files if f.sha256 not in holdings.files)
        groups.setdefault(lacking, []).append(host)
    shipments = []
    for files, hosts in sorted(groups.items(), key=lambda group: -len(group[1])):
        size, sha256 = tar_of(model, files)
        shipments.append(Shipment(tuple(hosts), files, size, sha256, files == model.files))
    return shipments
