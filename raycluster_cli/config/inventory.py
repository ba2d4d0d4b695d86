"""The inventory: YAML → a frozen, validated model. Errors name the YAML path and line and say the fix.

Only this module reads the inventory file; nothing here touches the network.
"""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from ipaddress import IPv4Address
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from raycluster_cli.config import strict_yaml
from raycluster_cli.config.owned import (
    MAX_CPUS,
    MAX_GPUS,
    MIN_WAIT_S,
    NUL_HINT,
    OWNED_ENV_HINT,
    nul_problem,
    owned_env_problem,
)
from raycluster_cli.config.paths import DEFAULT_INVENTORY, INVENTORY_ENV, resolve_path
from raycluster_cli.config.references import host_dir_problem, hostname_problem, image_problem, login_problem
from raycluster_cli.errors import InventoryError

# Every pattern is applied with fullmatch: `$` would let a trailing newline through ("demo\n").
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}", re.ASCII)
_SIZE = re.compile(r"\d{1,15}(\.\d{1,6})?[bkmg]?", re.IGNORECASE | re.ASCII)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
_RESOURCE_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,128}", re.ASCII)
_ENGINE_WORD = re.compile(r"[A-Za-z0-9_./:=+-]+", re.ASCII)
_JUMP = re.compile(r"(?:[^@\s,:]+@)?(?:\[[0-9A-Fa-f:]+\]|[^@\s,:\[\]]+)(?::\d{1,5})?", re.ASCII)
_BUILTIN_RESOURCES = {"CPU", "GPU", "memory", "object_store_memory"}


class FieldProblem(ValueError):
    """A problem found across fields: `loc` is the path of the field to name (and to find the line of)."""

    def __init__(self, loc: tuple[str | int, ...], message: str, hint: str = "") -> None:
        super().__init__(message)
        self.loc = loc
        self.hint = hint


def _grammar(check: Any) -> Any:
    def validate(value: str) -> str:
        problem = check(value)
        if problem:
            raise ValueError(f"{value!r:.80} {problem}")
        return value

    return AfterValidator(validate)


def _shell_words(value: str) -> str:
    """A `docker run` option string is split like a shell line when the container is made: check it now."""
    try:
        shlex.split(value)
    except ValueError as exc:
        raise ValueError(f"{value!r:.80} is not a shell-quoted option ({exc}): balance its quotes") from None
    return value


def _usable_address(value: IPv4Address) -> IPv4Address:
    if value.is_unspecified or value.is_multicast or value.is_reserved or value == IPv4Address("255.255.255.255"):
        raise ValueError(f"{value} is not an address a host can be reached at; use the host's own IP")
    return value


def _host_dir(value: str) -> str:
    problem = host_dir_problem(value)
    if problem:
        raise ValueError(f"{value!r:.80} {problem}")
    return value.rstrip("/")


LoginName = Annotated[str, _grammar(login_problem)]
FilePath = Annotated[str, _grammar(nul_problem)]
HostDir = Annotated[str, AfterValidator(_host_dir)]
HostAddress = Annotated[IPv4Address, AfterValidator(_usable_address)]
ShellOption = Annotated[str, AfterValidator(_shell_words)]
Amount = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SSHConfig(_Model):
    """How raycluster logs in to every host (per-host `ssh:` overrides single keys)."""

    user: LoginName = "root"
    key: FilePath | None = Field(
        None, min_length=1, description="private key file; default: the SSH agent, then ~/.ssh/id_*"
    )
    port: int = Field(22, ge=1, le=65535)
    known_hosts: Literal["strict", "accept-new"] = "strict"
    known_hosts_file: FilePath = Field("~/.ssh/known_hosts", min_length=1)
    connect_timeout_s: float = Field(
        10.0, ge=MIN_WAIT_S, le=3600, description="TCP connect, banner, login, channel open"
    )
    connect_retries: int = Field(2, ge=0, le=10, description="retries of refused/reset/no-banner logins")
    keepalive_interval_s: float = Field(
        15.0, ge=MIN_WAIT_S, le=3600, description="a keepalive that wants a reply, this often"
    )
    keepalive_count_max: int = Field(3, ge=1, le=100, description="unanswered keepalives before a host is dropped")
    stall_timeout_s: float = Field(
        60.0, ge=MIN_WAIT_S, le=3600, description="a stream accepting no data this long fails"
    )
    max_parallel_logins: int = Field(8, ge=1, le=1000, description="SSH handshakes at once (sshd MaxStartups)")
    proxy_jump: str | None = Field(None, description="jump host(s) as OpenSSH's ProxyJump: user@bastion[:port][,…]")
    config_file: FilePath | None = Field("~/.ssh/config", description="OpenSSH client config to read (null: none)")
    sudo: bool = Field(
        False, strict=True, description="create/remove the host state folder with `sudo -n` (a non-root login)"
    )

    @field_validator("proxy_jump")
    @classmethod
    def _jump(cls, value: str | None) -> str | None:
        return _check_jump(value)


class HostSSH(_Model):
    user: LoginName | None = None
    key: FilePath | None = Field(None, min_length=1)
    port: int | None = Field(None, ge=1, le=65535)
    proxy_jump: str | None = Field(None, description="this host's jump host(s) ('none': connect directly)")
    sudo: bool | None = Field(None, strict=True, description="this host's ssh.sudo")

    @field_validator("proxy_jump")
    @classmethod
    def _jump(cls, value: str | None) -> str | None:
        return _check_jump(value)


def _check_jump(value: str | None) -> str | None:
    if (
        value is not None
        and value.strip().lower() != "none"
        and not all(_JUMP.fullmatch(p.strip()) for p in value.split(","))
    ):
        raise ValueError("use [user@]host[:port], several separated by commas, or none")
    return value


class DockerConfig(_Model):
    """Container settings: cluster-wide under `docker:`, per host under `hosts[].docker`."""

    shm_size: str | None = None
    run_options: list[ShellOption] = Field(default_factory=list)
    engine: str | None = Field(None, description="docker (default), podman, or a prefix such as 'sudo -n docker'")

    @field_validator("engine")
    @classmethod
    def _engine(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            words = shlex.split(value)
        except ValueError:
            words = []
        if not words or not all(_ENGINE_WORD.fullmatch(w) for w in words):
            raise ValueError("use docker, podman, or a command prefix such as 'sudo -n docker'")
        return " ".join(words)

    @field_validator("shm_size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None and not _SIZE.fullmatch(value):
            raise ValueError("use a Docker size such as 2g or 512m")
        return value


class RayConfig(_Model):
    port: int = Field(6379, ge=1, le=65535)
    dashboard_port: int = Field(8265, ge=1, le=65535)
    client_port: int = Field(10001, ge=1, le=65535)
    object_store_memory: int | None = Field(None, gt=0, description="bytes; default: Ray's own choice")
    auth: Literal["token", "none"] = "token"
    min_worker_port: int = Field(10002, ge=1024, le=65535, description="first port of Ray's worker processes")
    max_worker_port: int = Field(19999, ge=1024, le=65535, description="last port of Ray's worker processes")
    metrics_export_port: int = Field(
        8080, ge=1, le=65535, description="port of every node's Prometheus metrics (on the node's IP)"
    )

    @model_validator(mode="after")
    def _worker_ports(self) -> RayConfig:
        if self.min_worker_port > self.max_worker_port:
            raise ValueError(f"min_worker_port {self.min_worker_port} is above max_worker_port {self.max_worker_port}")
        fixed = {self.port, self.dashboard_port, self.client_port, self.metrics_export_port}
        inside = sorted(p for p in fixed if self.min_worker_port <= p <= self.max_worker_port)
        if inside:
            raise ValueError(f"port {inside[0]} lies inside the worker port range: move it or the range")
        return self


class HeadConfig(_Model):
    address: HostAddress


def _check_env(value: dict[str, str]) -> dict[str, str]:
    for name, text in value.items():
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not an environment variable name (letters, digits, '_')")
        problem = owned_env_problem(name)
        if problem:
            raise FieldProblem((name,), problem, OWNED_ENV_HINT)
        if nul_problem(text):
            raise FieldProblem((name,), f"the value {nul_problem(text)}", NUL_HINT)
    return value


class HostConfig(_Model):
    address: HostAddress
    role: Literal["head", "worker"] = "worker"
    hostname: Annotated[str, _grammar(hostname_problem)] | None = Field(
        None, description="hostname of the Ray container; default: the host's own hostname"
    )
    # `ray start --num-cpus` takes a whole number (0: a node that runs no tasks, e.g. a busy head of a large
    # cluster); a fraction here would only fail later, inside the node's container.
    num_cpus: int | None = Field(None, ge=0, le=MAX_CPUS)
    num_gpus: int | None = Field(None, ge=0, le=MAX_GPUS)
    resources: dict[str, Amount] = Field(default_factory=dict, description="custom Ray resources of this node")
    env: dict[str, str] = Field(default_factory=dict, description="environment of this host's Ray processes")
    ssh: HostSSH = HostSSH()
    docker: DockerConfig = DockerConfig()

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_env(value)

    @field_validator("resources")
    @classmethod
    def _resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in _BUILTIN_RESOURCES:
                raise ValueError(f"{name} is set with num_cpus/num_gpus or ray settings, not resources")
            if not _RESOURCE_NAME.fullmatch(name):
                raise ValueError(f"{name!r:.80} is not a usable resource name (letters, digits, '_.:/-')")
            if not math.isfinite(amount) or amount < 0:
                raise ValueError(f"resource {name} must be a finite amount, not negative")
        return value


class Inventory(_Model):
    cluster: str
    image: Annotated[str, _grammar(image_problem)]
    image_source: Literal["stream", "pull"] = Field(
        "stream", description="how `up` gets the image onto a host that lacks it: stream it over SSH, or docker pull"
    )
    env: dict[str, str] = Field(default_factory=dict, description="environment of every host's Ray processes")
    host_state_dir: HostDir | None = Field(
        None,
        description="folder on each host for the cluster's files (token, env files); default /etc/raycluster "
        "for root or with ssh.sudo, else ~/.local/state/raycluster (the login user's home)",
    )
    ssh: SSHConfig = SSHConfig()
    head: HeadConfig | None = None
    ray: RayConfig = RayConfig()
    docker: DockerConfig = Field(default_factory=lambda: DockerConfig(shm_size="2g"))
    hosts: list[HostConfig] = Field(min_length=1)

    @field_validator("cluster")
    @classmethod
    def _cluster_name(cls, value: str) -> str:
        if not _NAME.fullmatch(value):
            raise ValueError(f"{value!r:.80}: use lower-case letters, digits, '-', '_' or '.' (at most 63), e.g. demo")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_env(value)

    @model_validator(mode="after")
    def _roles(self) -> Inventory:
        heads = [h for h in self.hosts if h.role == "head"]
        if len(heads) != 1:
            raise FieldProblem(("hosts",), f"exactly one host needs role: head (found {len(heads)})")
        first: dict[IPv4Address, int] = {}
        for index, host in enumerate(self.hosts):
            if host.address in first:
                raise FieldProblem(
                    ("hosts", index, "address"),
                    f"{host.address} is listed twice (also hosts[{first[host.address]}])",
                    "list each host once",
                )
            first[host.address] = index
        self._check_addresses(first)
        return self

    def _check_addresses(self, index_of: dict[IPv4Address, int]) -> None:
        """Loopback only where every address is (one machine); head.address is no worker's address."""
        remote = [h for h in self.hosts if not h.address.is_loopback]
        if remote:
            for index, host in enumerate(self.hosts):
                if host.address.is_loopback:
                    raise FieldProblem(
                        ("hosts", index, "address"),
                        f"{host.address} is a loopback address in a cluster with other machines ({remote[0].address})",
                        "use each host's address on the cluster network",
                    )
            if self.head and self.head.address.is_loopback:
                raise FieldProblem(
                    ("head", "address"),
                    f"{self.head.address} is a loopback address: the workers on other machines cannot reach it",
                    "use the head host's address on the cluster network",
                )
        if self.head and self.head.address in index_of:
            other = self.hosts[index_of[self.head.address]]
            if other.role != "head":
                raise FieldProblem(
                    ("head", "address"),
                    f"{self.head.address} is the address of worker hosts[{index_of[self.head.address]}]",
                    "use an address of the head host (or fix the roles)",
                )

    # Derived views -------------------------------------------------------------------------------

    @property
    def head_host(self) -> HostConfig:
        return next(h for h in self.hosts if h.role == "head")

    @property
    def workers(self) -> list[HostConfig]:
        return [h for h in self.hosts if h.role == "worker"]

    @property
    def head_address(self) -> str:
        """The IP that workers use to reach the head (default: the head host's own address)."""
        return str(self.head.address if self.head else self.head_host.address)

    def node_ip(self, host: HostConfig) -> str:
        """The IP the Ray node on `host` registers with."""
        return self.head_address if host.role == "head" else str(host.address)

    def docker_for(self, host: HostConfig) -> DockerConfig:
        """Cluster-wide docker settings with the host's own on top (run_options are appended)."""
        return DockerConfig(
            shm_size=host.docker.shm_size or self.docker.shm_size,
            run_options=[*self.docker.run_options, *host.docker.run_options],
            engine=host.docker.engine or self.docker.engine,
        )

    def env_for(self, host: HostConfig) -> dict[str, str]:
        """Cluster-wide `env` with the host's own on top."""
        return {**self.env, **host.env}

    def ssh_for(self, host: HostConfig) -> SSHConfig:
        override = {k: v for k, v in host.ssh.model_dump().items() if v is not None}
        return self.ssh.model_copy(update=override)


@dataclass(frozen=True)
class LoadedInventory:
    inventory: Inventory
    path: Path


def load(explicit: str | os.PathLike[str] | None = None) -> LoadedInventory:
    path = resolve_path(explicit)
    try:
        with path.open("rb") as handle:
            data = handle.read(strict_yaml.MAX_BYTES + 1)  # never more than the cap into memory
    except FileNotFoundError:
        raise InventoryError(
            f"inventory {path} not found",
            f"pass -i FILE, set ${INVENTORY_ENV}, or copy inventory.example.yaml to {DEFAULT_INVENTORY}",
        ) from None
    except OSError as exc:
        raise InventoryError(f"inventory {path}: {exc.strerror}", "check the path and its permissions") from None
    return LoadedInventory(parse_bytes(data, str(path)), path.resolve())


def parse_bytes(data: bytes, source: str = "<inventory>") -> Inventory:
    """Parse inventory file content: UTF-8 only, at most strict_yaml.MAX_BYTES."""
    try:
        text = strict_yaml.decode(data)
    except strict_yaml.YamlProblem as problem:
        raise _yaml_error(problem, source) from None
    return parse(text, source)


def check_key_files(loaded: LoadedInventory) -> None:
    """Every `ssh.key` the inventory names is a file (checked once at load, before any host is dialled)."""
    inv = loaded.inventory
    named = [(("ssh", "key"), inv.ssh.key)] + [(("hosts", i, "ssh", "key"), h.ssh.key) for i, h in enumerate(inv.hosts)]
    for loc, key in named:
        if key is None:
            continue
        path = Path(os.path.expanduser(key))
        field = _dotted(loc)
        if not path.exists():
            raise InventoryError(
                f"{loaded.path}: {field}: {key} does not exist",
                f"fix {field}, or remove it to log in with the SSH agent and the default keys (~/.ssh/id_*)",
            )
        if path.is_dir():
            raise InventoryError(
                f"{loaded.path}: {field}: {key} is a directory, not a private key file",
                f"point {field} at the private key file, e.g. ~/.ssh/id_ed25519",
            )


def parse(text: str, source: str = "<inventory>") -> Inventory:
    """Parse and validate inventory YAML; raise InventoryError naming `source:line` and the field."""
    try:
        root, data = strict_yaml.load(text)
    except strict_yaml.YamlProblem as problem:
        raise _yaml_error(problem, source) from None
    if not isinstance(data, dict):
        raise InventoryError(f"{source}: the inventory must be a mapping", "see inventory.example.yaml")
    try:
        return Inventory.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc, message, hint = tuple(first["loc"]), _message(first), ""
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, FieldProblem):
            loc, message, hint = loc + cause.loc, str(cause), cause.hint
        field = _dotted(loc) or "(top level)"
        line = _line_of(root, loc)
        where = f"{source}:{line}" if line else source
        raise InventoryError(f"{where}: {field}: {message}", hint or _hint(first, field)) from None


def _yaml_error(problem: strict_yaml.YamlProblem, source: str) -> InventoryError:
    where = f"{source}:{problem.line}" if problem.line else source
    if "duplicate key" in problem.message:
        hint = "keep one of the two: YAML would silently use the last"
    elif problem.line is None:
        hint = "check that this is the inventory (a small UTF-8 YAML file)"
    else:
        hint = "fix the file at that line"
    return InventoryError(f"{where}: {problem.message}", hint)


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        name = str(part) if str(part).isprintable() and str(part).strip() == str(part) else repr(str(part))
        out += f"[{part}]" if isinstance(part, int) else (f".{name}" if out else name)
    return out


def _message(error: Any) -> str:
    msg = str(error["msg"])
    return " ".join(msg.removeprefix("Value error, ").split())


def _hint(error: Any, field: str) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"remove {field} or check its spelling (see inventory.example.yaml)"
    if kind == "missing":
        return f"add {field} (see inventory.example.yaml)"
    if "ip" in kind:
        return "use an IPv4 address such as 192.0.2.11"
    if kind == "bool_type":
        return f"write {field}: true or {field}: false"
    return "see inventory.example.yaml for the accepted values"


def _walk(node: yaml.Node | None, loc: tuple[Any, ...]) -> Iterator[yaml.Node]:
    """Yield the nodes along `loc` as far as the YAML goes."""
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if getattr(k, "value", None) == part), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
        else:
            return
        if node is None:
            return
        yield node


def _line_of(root: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    nodes = list(_walk(root, loc))
    node = nodes[-1] if nodes else root
    return node.start_mark.line + 1 if node is not None else None
