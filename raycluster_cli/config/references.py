"""What Docker and the kernel accept as an image reference, a container hostname and a login name.

Image references follow the grammar of Docker's reference package (distribution/reference):
`name[:tag][@digest]`, where name is `[domain[:port]/]path-component[/path-component…]`, a path component
is lower-case alphanumerics joined by `.`, `_`, `__` or dashes, a tag is `[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}`
and a digest `algorithm:hex` (at least 32 hex digits). The whole name is at most 255 characters.
Every pattern is applied with `fullmatch`, so a trailing newline never passes.
"""

from __future__ import annotations

import re

_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|-+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
_DOMAIN_NAME = rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*"
_IPV6 = r"\[[A-Fa-f0-9:]+\]"
_DOMAIN = rf"(?:{_DOMAIN_NAME}|{_IPV6})(?::[0-9]+)?"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE_REFERENCE = re.compile(rf"(?P<name>{_NAME})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?", re.ASCII)
MAX_IMAGE_NAME = 255
MAX_IMAGE_REFERENCE = 512  # name, tag (128) and a sha512 digest fit; checked before the pattern runs

# RFC 1123 host names: labels of letters, digits and inner dashes, joined by dots; the kernel keeps 64 bytes.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*", re.ASCII)
MAX_HOSTNAME = 64

# A folder on the hosts: absolute, or under the login user's home (`~/…`); plain path characters only, so that
# it is one shell word and one `docker run --volume` source without quoting surprises.
HOST_DIR = re.compile(r"(?:/|~/)[A-Za-z0-9_.@+-]+(?:/[A-Za-z0-9_.@+-]+)*", re.ASCII)
MAX_HOST_DIR = 200

# Login names as useradd and directory services make them (no leading dash: it would read as an option).
LOGIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@-]{0,63}", re.ASCII)


def image_problem(value: str) -> str | None:
    """Why `value` is not an image reference Docker accepts, or None."""
    if len(value) > MAX_IMAGE_REFERENCE:
        return f"is longer than {MAX_IMAGE_REFERENCE} characters"
    match = IMAGE_REFERENCE.fullmatch(value)
    if not match:
        return "is not a Docker image reference: name[:tag][@digest], lower-case name, e.g. raycluster/node:0.1.0"
    if len(match["name"]) > MAX_IMAGE_NAME:
        return f"has a name longer than {MAX_IMAGE_NAME} characters"
    return None


def hostname_problem(value: str) -> str | None:
    """Why `value` cannot be a container hostname, or None."""
    if len(value) > MAX_HOSTNAME:
        return f"is longer than {MAX_HOSTNAME} characters (the kernel's limit for a hostname)"
    if not HOSTNAME.fullmatch(value):
        return "is not a hostname: letters, digits and inner '-', in labels joined by '.', e.g. gpu-node-2"
    return None


def login_problem(value: str) -> str | None:
    """Why `value` cannot be an SSH login name, or None."""
    if not LOGIN_NAME.fullmatch(value):
        return "is not a login name: letters, digits, '_', '.', '@', '-', not starting with '-', e.g. ubuntu"
    return None


def host_dir_problem(value: str) -> str | None:
    """Why `value` cannot be the folder on the hosts that holds raycluster's files, or None."""
    if len(value) > MAX_HOST_DIR:
        return f"is longer than {MAX_HOST_DIR} characters"
    if not HOST_DIR.fullmatch(value.rstrip("/")) or value.rstrip("/") in ("", "~"):
        return (
            "is not a folder path: absolute (/var/lib/raycluster) or under the login user's home "
            "(~/.local/state/raycluster), letters, digits and '_.@+-' only"
        )
    if any(part in (".", "..") for part in value.split("/")):
        return "contains '.' or '..': write the folder's plain path"
    return None
