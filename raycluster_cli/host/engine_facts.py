"""What the container engine says on a host, read once per host and shared by every check and step of a verb.

Three command facts carry every engine reading a verb needs: `ENGINE` (one `docker info`, with the free disk
of the engine's folder), `IMAGE` (one `docker image inspect` of the inventory's image, with Ray's and
Python's versions inside it, cached on the host per image ID) and `CONTAINERS` (one `docker ps -a`). The
checks and `up` judge facts derived from these (`derived` in facts.py) instead of running the engine's CLI
again: on a fleet whose hosts are busy, each start of that CLI (a Go binary talking to the host's daemon)
costs real CPU, and it was 8 such starts per host in `doctor` before.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from raycluster_cli.host.engine import PsRow, dialect_for, image_id, ps_rows
from raycluster_cli.host.facts import Fact, HostContext, raw
from raycluster_cli.transport import CommandResult, quote

NO_IMAGE = "no-image"


def split_sections(text: str, count: int) -> list[str]:
    """The output of `a; echo ---; b; ...` as `count` sections (missing ones are empty)."""
    parts = re.split(r"^---$\n?", text, flags=re.MULTILINE)
    return (parts + [""] * count)[:count]


def engine_command(ctx: HostContext) -> str:
    """`docker info` once: version, the engine's folder (and Docker's runtimes) a line each, then `---` and the
    free disk of that folder and /tmp. When the engine refuses, `docker info --format` hides why behind
    "template: … nil pointer": `docker ps` then says it (permission denied, a sudo that wants a password, a
    daemon that is down), on stderr and in the exit status."""
    dialect = dialect_for(ctx.inventory, ctx.host)
    return (
        f"if i=$(docker info --format {shlex.quote(dialect.info_format())} 2>/dev/null); "
        """then x=0; printf '%s\\n' "$i"; else docker ps --quiet --last 1; x=$?; i=; fi; echo ---; """
        f"""printf '%s\\n' "$i" | {{ read -r v; read -r r; df -P -B1 "${{r:-{dialect.default_root}}}" /tmp 2>&1; }}; """
        "exit $x"
    )


@dataclass(frozen=True)
class EngineInfo:
    result: CommandResult  # the fact's own result (rc and stderr: the engine's answer)
    version: str
    root: str  # '' when the engine did not answer
    runtimes: str  # Docker's `{{json .Runtimes}}` ('' for Podman)
    df: str  # `df -P -B1 <root> /tmp`

    @property
    def answers(self) -> bool:
        return self.result.rc == 0 and bool(self.version)


def parse_engine(result: CommandResult) -> EngineInfo:
    info, df = split_sections(result.stdout, 2)
    lines = ([*info.splitlines(), "", "", ""])[:3]
    if result.rc != 0:
        return EngineInfo(result, "", "", "", df)
    return EngineInfo(result, lines[0].strip(), lines[1].strip(), lines[2].strip(), df)


_VERSIONS_SCRIPT = (
    "import sys, importlib.metadata as m; print('python', sys.version.split()[0]); print('ray', m.version('ray'))"
)


def image_command(ctx: HostContext) -> str:
    """`docker image inspect` once: `<id> <size>`, then `---` and Ray and Python inside the image, cached on the
    host per image ID (a `docker run` costs a second); `no-image` (exit 1, the engine's error on stderr) when
    the image is absent. Each reader writes its own temporary file and renames it into place: readers side by
    side (two verbs on one host, hosts sharing an NFS home) once shared one `.tmp`, and the one whose file
    had been renamed away failed the image-runtime check."""
    image = quote(ctx.inventory.image)
    run = quote("docker", "run", "--rm", "--network=none", "--entrypoint=python3", ctx.inventory.image, "-c")
    return (
        f"i=$(docker image inspect --format '{{{{.Id}}}} {{{{.Size}}}}' {image}) || {{ echo {NO_IMAGE}; exit 1; }}; "
        'echo "$i"; echo ---; id=${i%% *}; '
        'c="${XDG_CACHE_HOME:-$HOME/.cache}/raycluster/versions-${id#sha256:}"; '
        'if [ ! -s "$c" ]; then t=; mkdir -p "${c%/*}" && t=$(mktemp "$c.XXXXXX") && '
        f'{run} {shlex.quote(_VERSIONS_SCRIPT)} > "$t" 2>&1 && mv -f "$t" "$c"'
        ' || { cat "${t:-$c}"; rm -f "$t"; exit 1; }; fi; cat "$c"'
    )


@dataclass(frozen=True)
class ImageInfo:
    result: CommandResult
    id: str  # `sha256:<hex>`; '' when the image is absent
    size: int | None
    versions: str  # the versions section (lines `python X`, `ray Y`, or why they could not be read)


def parse_image(result: CommandResult) -> ImageInfo:
    head, versions = split_sections(result.stdout, 2)
    words = head.split()
    if not words or words[0] == NO_IMAGE:
        return ImageInfo(result, "", None, "")
    size = int(words[1]) if len(words) > 1 and words[1].isdigit() else None
    return ImageInfo(result, image_id(words[0]), size, versions)


def containers_command(ctx: HostContext) -> str:
    """`docker ps -a` once: every container (id, name, state, image, labels) as JSON."""
    return "docker ps --all --no-trunc --format '{{json .}}'"


def parse_containers(result: CommandResult) -> list[PsRow]:
    """The host's containers; [] when the engine did not answer (the docker check says why)."""
    if result.rc != 0:
        return []
    try:
        return ps_rows(result.stdout)
    except ValueError:
        return []


ENGINE: Fact[CommandResult] = raw("engine", engine_command)
IMAGE: Fact[CommandResult] = raw("image", image_command)
CONTAINERS: Fact[CommandResult] = raw("containers", containers_command)


def running(rows: list[PsRow], labels: dict[str, str] | None = None) -> list[PsRow]:
    """The running containers among `rows` that carry every label in `labels`."""
    wanted = labels or {}
    return [r for r in rows if r.state == "running" and all(r.labels.get(k) == v for k, v in wanted.items())]
