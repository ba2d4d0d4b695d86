"""The container engine's dialects on a host: where Podman's CLI answers differently from Docker's.

Which program runs `docker` on a host (`docker.engine`: `podman`, `sudo -n docker`, …) is transport/engine_shim.py's
concern; every command raycluster sends is written with the Docker CLI's grammar.

Where the two CLIs differ (measured with Debian's podman 4.3.1 against Docker 20.10), a `Dialect` gives the
text for the host's engine, and the parsers here read either engine's output:
- `info --format`: Docker's `.ServerVersion` / `.DockerRootDir` are Podman's `.Version.Version` /
  `.Store.GraphRoot`; Podman has no `.Runtimes` (GPUs come through CDI specs instead of an nvidia runtime);
- image IDs: Docker prints `sha256:<hex>`, Podman the bare hex (`image_id` gives the first form for both);
- `ps --format '{{json .}}'`: Docker prints one object a line (`ID`, `Names` and `Labels` as strings),
  Podman one JSON array (`Id`, `Names` a list, `Labels` an object) (`ps_rows` reads both);
- `ps --format` of one label: `{{.Label "k"}}` for Docker, `{{index .Labels "k"}}` for Podman;
- `top`: Docker's `-eo pid` lists host PIDs, Podman's lists the container's own (`hpid` gives the host's);
- `cp -L` (follow a symbolic link): Podman has no `-L` and resolves the container path itself;
- `run --gpus …`: Podman 4 takes GPUs as CDI devices, `--device nvidia.com/gpu=…`.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from typing import Any

from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.transport.engine_shim import engine_of


@dataclass(frozen=True)
class Dialect:
    """The words of an engine command that differ between Docker's CLI and Podman's."""

    name: str  # "docker" or "podman"
    version_format: str  # `docker info --format` printing the engine's version
    root_format: str  # ... printing the folder that holds images and containers
    default_root: str
    top_host_pids: str  # `docker top ID <this>` lists the container's processes by host PID
    copy_out: str  # `docker <this> CONTAINER:PATH -`, following a symbolic link in PATH

    def label_format(self, key: str) -> str:
        """A `docker ps --format` template printing one label of each container."""
        if self.name == "podman":
            return '{{index .Labels "' + key + '"}}'
        return '{{.Label "' + key + '"}}'

    def info_format(self) -> str:
        """One `docker info --format` template: the version, the engine's folder and (Docker) the runtimes, a
        line each (`{{println}}` is Go's template builtin, so the command stays on one line)."""
        runtimes = "" if self.name == "podman" else "{{println}}{{json .Runtimes}}"
        return f"{self.version_format}{{{{println}}}}{self.root_format}{runtimes}"

    def gpu_support_command(self) -> str:
        """Prints what makes GPUs reachable in containers: Docker's runtimes, or Podman's CDI device names."""
        if self.name == "podman":
            return "cat /etc/cdi/*.yaml /etc/cdi/*.json /var/run/cdi/*.yaml /var/run/cdi/*.json 2>/dev/null"
        return "docker info --format '{{json .Runtimes}}' 2>&1"


DOCKER = Dialect("docker", "{{.ServerVersion}}", "{{.DockerRootDir}}", "/var/lib/docker", "-eo pid", "cp -L")
PODMAN = Dialect("podman", "{{.Version.Version}}", "{{.Store.GraphRoot}}", "/var/lib/containers", "hpid", "cp")


def dialect_of(engine: str) -> Dialect:
    """Podman's dialect for `podman`, `/usr/bin/podman`, `sudo -n podman`…; Docker's otherwise."""
    words = shlex.split(engine)
    return PODMAN if any(word.rsplit("/", 1)[-1] == "podman" for word in words) else DOCKER


def dialect_for(inventory: Inventory, host: HostConfig) -> Dialect:
    return dialect_of(engine_of(inventory, host))


_HEX_ID = re.compile(r"(?:sha256:)?([0-9a-f]{64})")


def image_id(text: str) -> str:
    """An image ID as `sha256:<hex>` from either engine's `inspect` output; '' when it is none."""
    match = _HEX_ID.fullmatch(text.strip())
    return f"sha256:{match.group(1)}" if match else ""


@dataclass(frozen=True)
class PsRow:
    id: str
    name: str
    state: str
    image: str
    labels: dict[str, str]


def ps_rows(text: str) -> list[PsRow]:
    """Containers from `docker ps --format '{{json .}}'` of either engine (see the module docstring)."""
    stripped = text.strip()
    if not stripped:
        return []
    # Raises ValueError (naming what it got) for output that is not one JSON object per container; a field of
    # another type than either engine prints reads as empty.
    lines = [line for line in stripped.splitlines() if line.strip()]
    raw: Any = json.loads(stripped) if stripped.startswith("[") else [_json(line) for line in lines]
    rows = []
    for row in raw if isinstance(raw, list) else [raw]:
        if not isinstance(row, dict):
            raise ValueError(f"a row of its JSON is not an object: {json.dumps(row)[:80]}")
        names, labels = row.get("Names", ""), row.get("Labels") or {}
        if isinstance(labels, str):
            labels = dict(item.partition("=")[::2] for item in labels.split(",") if item)
        labels = {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}
        name = names[0] if isinstance(names, list) and names else names if isinstance(names, str) else ""
        ident = row.get("ID") or row.get("Id") or ""
        rows.append(PsRow(_text(ident), _text(name), _text(row.get("State")), _text(row.get("Image")), labels))
    return rows


def _json(line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        raise ValueError(f"not its JSON: {line.strip()[:80]!r}") from None


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def adapt_run_argv(dialect: Dialect, argv: list[str]) -> list[str]:
    """`docker run` arguments for the host's engine: for Podman, `--gpus X` becomes CDI devices, and the restart
    policy `unless-stopped` becomes `always`: Podman has no engine that starts containers at boot, and its
    podman-restart.service starts only those of `always` (an operator's `podman stop` still keeps one stopped
    until then)."""
    if dialect.name != "podman":
        return argv
    out: list[str] = []
    words = iter(argv)
    for word in words:
        if word == "--restart=unless-stopped":
            out.append("--restart=always")
        elif word == "--gpus":
            out += _cdi_devices(next(words, "all"))
        elif word.startswith("--gpus="):
            out += _cdi_devices(word.split("=", 1)[1])
        else:
            out.append(word)
    return out


def _cdi_devices(spec: str) -> list[str]:
    """Docker's `--gpus` value (all, a count, or device=0,1) as Podman's CDI `--device` options."""
    spec = spec.strip().strip("'\"")
    if spec.startswith("device="):
        ids = [i for i in spec.removeprefix("device=").split(",") if i]
    elif spec.isdigit():
        ids = [str(i) for i in range(int(spec))]
    else:
        ids = ["all"]
    return [f"--device=nvidia.com/gpu={i}" for i in ids]
