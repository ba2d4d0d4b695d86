"""known_hosts as OpenSSH reads it: the user's file, then /etc/ssh/ssh_known_hosts; `@revoked` keys refused;
`@cert-authority` lines understood (and refused, naming file and line, for a host they alone would vouch for:
raycluster does not check CA-signed host keys); name patterns (`*`, `?`, `!`), `[host]:port` and hashed names
matched as OpenSSH does. A line that cannot be read is skipped, as OpenSSH skips it, never an error at login.

Each file is parsed once per run (again only when it changed, e.g. after accept-new recorded a key).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

# OpenSSH's GlobalKnownHostsFile default (ssh_config(5)), read after the user's file.
GLOBAL_FILES: tuple[Path, ...] = (Path("/etc/ssh/ssh_known_hosts"), Path("/etc/ssh/ssh_known_hosts2"))
MAX_FILE_BYTES = 16 * 1024 * 1024  # a known_hosts file larger than this is not read whole
_MARKERS = ("@revoked", "@cert-authority")


@dataclass(frozen=True)
class Line:
    marker: str  # "", "@revoked" or "@cert-authority"
    patterns: tuple[str, ...]
    key: paramiko.PKey | None  # None: a CA key of a type paramiko does not know (only its place matters)
    where: str  # FILE:LINE


@dataclass
class Matches:
    """What the files say about one target."""

    keys: list[paramiko.PKey] = field(default_factory=list)
    revoked: list[tuple[paramiko.PKey, str]] = field(default_factory=list)
    authorities: list[str] = field(default_factory=list)  # FILE:LINE of each matching @cert-authority line

    def revoked_at(self, key: paramiko.PKey) -> str | None:
        return next((where for bad, where in self.revoked if _same(bad, key)), None)


@dataclass(frozen=True)
class KnownHosts:
    lines: tuple[Line, ...]

    def for_target(self, target: str) -> Matches:
        """The lines for `target` (`host`, or `[host]:port` off port 22); revoked keys never among `keys`."""
        found = Matches()
        for line in self.lines:
            if not _matches(line.patterns, target.lower()):
                continue
            if line.marker == "@cert-authority":
                found.authorities.append(line.where)
            elif line.marker == "@revoked" and line.key is not None:
                found.revoked.append((line.key, line.where))
            elif line.key is not None:
                found.keys.append(line.key)
        found.keys = [k for k in found.keys if found.revoked_at(k) is None]
        return found


_lock = threading.Lock()
_cache: dict[Path, tuple[tuple[int, int], tuple[Line, ...]]] = {}


def forget() -> None:
    with _lock:
        _cache.clear()


def read(files: list[Path]) -> KnownHosts:
    """Every line of `files` that exist, in order. Raises OSError for a file that exists and cannot be read."""
    lines: list[Line] = []
    for path in files:
        lines += _parsed(path)
    return KnownHosts(tuple(lines))


def _parsed(path: Path) -> tuple[Line, ...]:
    try:
        stat = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return ()
    stamp = (stat.st_mtime_ns, stat.st_size)
    with _lock:
        cached = _cache.get(path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
    with path.open("rb") as handle:
        text = handle.read(MAX_FILE_BYTES).decode(errors="replace")
    lines = tuple(line for number, raw in enumerate(text.splitlines(), 1) if (line := _line(raw, f"{path}:{number}")))
    with _lock:
        _cache[path] = (stamp, lines)
    return lines


def _line(raw: str, where: str) -> Line | None:
    fields = raw.split()
    if not fields or fields[0].startswith("#"):
        return None
    marker = ""
    if fields[0].startswith("@"):
        marker = fields.pop(0)
        if marker not in _MARKERS:
            return None
    if len(fields) < 3:
        return None
    patterns, key_type, data = fields[:3]
    try:
        key: paramiko.PKey | None = paramiko.PKey.from_type_string(key_type, base64.b64decode(data, validate=True))
    except (binascii.Error, ValueError, paramiko.SSHException):
        key = None
    if key is None and marker != "@cert-authority":
        return None  # a key that cannot be read vouches for nothing (OpenSSH skips the line too)
    return Line(marker, tuple(patterns.split(",")), key, where)


def _matches(patterns: tuple[str, ...], target: str) -> bool:
    """OpenSSH's match_hostname: some pattern matches and no negated one does; hashed names are one name."""
    matched = False
    for pattern in patterns:
        if pattern.startswith("|1|"):
            if _hashed_match(pattern, target):
                matched = True
            continue
        negated = pattern.startswith("!")
        if _glob(pattern.removeprefix("!").lower(), target):
            if negated:
                return False
            matched = True
    return matched


def _glob(pattern: str, name: str) -> bool:
    """`*` and `?` only: `[` is literal (`[host]:port`), unlike fnmatch."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, name, re.DOTALL) is not None


def _hashed_match(pattern: str, target: str) -> bool:
    try:
        salt_b64, digest_b64 = pattern[3:].split("|", 1)
        salt, digest = base64.b64decode(salt_b64), base64.b64decode(digest_b64)
    except (ValueError, binascii.Error):
        return False
    return hmac.compare_digest(hmac.new(salt, target.encode(), hashlib.sha1).digest(), digest)


def _same(one: paramiko.PKey, other: paramiko.PKey) -> bool:
    return one.get_name() == other.get_name() and one.asbytes() == other.asbytes()


def fingerprint(key: paramiko.PKey) -> str:
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
