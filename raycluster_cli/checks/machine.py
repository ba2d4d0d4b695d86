"""Runtime checks on one host: Docker, the image and what is inside it, memory, disk, /dev/shm, GPUs, stale Ray."""

from __future__ import annotations

import shlex

from raycluster_cli.checks.base import CheckContext, Finding, Status
from raycluster_cli.checks.parsers_machine import (
    gib,
    parse_df,
    parse_docker_size,
    parse_meminfo,
    parse_nvidia_smi,
    parse_ray_processes,
    parse_runtimes,
    parse_versions,
)
from raycluster_cli.host import folders
from raycluster_cli.host.containers import LABEL_CLUSTER
from raycluster_cli.host.engine import dialect_for, image_id
from raycluster_cli.host.engine_facts import (
    NO_IMAGE,
    parse_containers,
    parse_engine,
    parse_image,
    running,
    split_sections,
)
from raycluster_cli.transport import CommandResult
from raycluster_cli.transport.engine_shim import engine_of
from raycluster_cli.versions import PYTHON_VERSION, RAY_VERSION

GIB = 1024**3
DOCKER_DEFAULT_SHM = 64 * 1024**2
OBJECT_STORE_SHARE = 0.3  # Ray's default object store: 30 % of the node's memory ...
OBJECT_STORE_CAP = 200 * 10**9  # ... at most 200 GB
RAY_HEADROOM = 1 * GIB  # raylet, GCS and a few workers besides the object store
MIN_DOCKER_ROOT_FREE = 1 * GIB
MIN_TMP_FREE = 1 * GIB


def docker(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    engine = engine_of(ctx.inventory, ctx.host)
    podman = dialect_for(ctx.inventory, ctx.host).name == "podman"
    if rc == 0 and out.strip():
        return Finding(Status.OK, f"{'Podman' if podman else 'Docker engine'} {out.strip()} answers ({engine})")
    text = (err or out).strip()
    user = folders.login_user(ctx.inventory, ctx.host)
    if rc == 127 or "not found" in text:
        if podman:
            return Finding(Status.FAIL, f"{engine} is not installed", f"on {ctx.address}: apt-get install podman")
        return Finding(Status.FAIL, "docker is not installed", f"install Docker Engine on {ctx.address}")
    if text.startswith("sudo:") or "\nsudo:" in text:
        return Finding(
            Status.FAIL,
            f"user {user} may not run `{engine}` without a password ({text.splitlines()[-1][:120]})",
            f"on {ctx.address}: a sudoers rule `{user} ALL=(root) NOPASSWD: /usr/bin/docker`, or usermod -aG docker "
            f"{user} (then log in again) and docker.engine: docker",
        )
    if "permission denied" in text.lower():
        return Finding(
            Status.FAIL,
            f"user {user} may not use Docker (`{engine}`: permission denied on the engine's socket)",
            f"on {ctx.address}: usermod -aG docker {user} (then log in again), or set docker.engine: sudo -n docker "
            f"for this host if {user} may run docker through sudo",
        )
    return Finding(
        Status.FAIL,
        f"Docker daemon does not answer ({text.splitlines()[-1] if text else f'exit {rc}'})",
        f"start it on {ctx.address}: systemctl start docker",
    )


def engine_refused(text: str) -> bool:
    """The engine's answer says this user may not use it (so a missing-image reading would be wrong)."""
    lowered = text.lower()
    return "permission denied" in lowered or "sudo:" in lowered


def image(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    name = ctx.inventory.image
    found = image_id(out) if rc == 0 else ""
    if found:
        return Finding(Status.OK, f"{name} present ({found[7:19]})", data={"image_id": found})
    if engine_refused(err):
        return Finding(Status.SKIP, "not checked: the engine refused this user (see the docker check)")
    return Finding(
        Status.FAIL,
        f"image {name} is not on this host",
        f"`raycluster up` streams it from this machine over SSH (or: docker save {name} | ssh {ctx.address} docker load)",
    )


def docker_view(ctx: CheckContext, results: list[CommandResult]) -> CommandResult:
    """`docker`'s input from the host's one `docker info` (enginefacts.ENGINE): the version, or the engine's
    refusal (its stderr and exit status)."""
    engine = results[0]
    info = parse_engine(engine)
    return CommandResult(
        engine.rc, f"{info.version}\n" if info.version else engine.stdout.split("---")[0], engine.stderr
    )


def image_view(ctx: CheckContext, results: list[CommandResult]) -> CommandResult:
    """`image`'s input (the image ID, or the engine's error) from the host's one `docker image inspect`."""
    found = parse_image(results[0])
    if found.id:
        return CommandResult(0, found.id + "\n", "")
    return CommandResult(results[0].rc or 1, "", results[0].stderr)


def image_runtime_view(ctx: CheckContext, results: list[CommandResult]) -> CommandResult:
    """`image_runtime`'s input (Ray's and Python's versions, or `no-image`) from the same reading."""
    found = parse_image(results[0])
    if not found.id:
        return CommandResult(0, NO_IMAGE + "\n", "")
    return CommandResult(results[0].rc, found.versions, results[0].stderr)


def image_runtime(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    if out.strip() == NO_IMAGE:
        return Finding(Status.SKIP, "image absent: versions not checked (see the image check)")
    found = parse_versions(out)
    name = ctx.inventory.image
    rebuild = f"rebuild {name} with ray[default]=={RAY_VERSION} on Python {PYTHON_VERSION} (docker/node/Dockerfile)"
    if rc != 0 or "ray" not in found:
        detail = (out or err).strip().splitlines()[-1:] or [f"exit {rc}"]
        return Finding(Status.FAIL, f"cannot read Ray's version inside {name} ({detail[0][:120]})", rebuild)
    data = {"ray": found["ray"], "python": found.get("python", "?")}
    if found["ray"] != RAY_VERSION:
        return Finding(Status.FAIL, f"{name} has Ray {found['ray']}, the CLI expects {RAY_VERSION}", rebuild, data)
    python = found.get("python", "")
    if ".".join(python.split(".")[:2]) != PYTHON_VERSION:
        return Finding(Status.WARN, f"{name} has Python {python}, the CLI expects {PYTHON_VERSION}", rebuild, data)
    return Finding(Status.OK, f"Ray {found['ray']}, Python {python} in the image", data=data)


def _shm_bytes(ctx: CheckContext) -> tuple[int, str]:
    """The /dev/shm size the Ray container gets (a --shm-size in run_options wins) and where it comes from."""
    docker_cfg = ctx.inventory.docker_for(ctx.host)
    size, source = docker_cfg.shm_size, "docker.shm_size"
    for option in docker_cfg.run_options:
        for part in shlex.split(option):
            if part.startswith("--shm-size="):
                size, source = part.split("=", 1)[1], "docker.run_options"
    if size is None:
        return DOCKER_DEFAULT_SHM, "Docker's default"
    return parse_docker_size(size) or DOCKER_DEFAULT_SHM, source


def object_store_bytes(ctx: CheckContext, mem_total: int) -> int:
    configured = ctx.inventory.ray.object_store_memory
    return configured if configured else min(int(mem_total * OBJECT_STORE_SHARE), OBJECT_STORE_CAP)


def _advice_size(size: int) -> str:
    return f"{-(-size // GIB)}g"


def shm(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    mem = parse_meminfo(out)
    if "MemTotal" not in mem:
        return Finding(Status.WARN, "cannot read /proc/meminfo", "check the host")
    have, source = _shm_bytes(ctx)
    need = object_store_bytes(ctx, mem["MemTotal"])
    data = {"shm_bytes": have, "object_store_bytes": need, "mem_total_bytes": mem["MemTotal"]}
    origin = "ray.object_store_memory" if ctx.inventory.ray.object_store_memory else "30 % of memory, Ray's default"
    if have < need:
        size = _advice_size(need)
        return Finding(
            Status.WARN,
            f"/dev/shm of the container ({gib(have)}, {source}) is below the object store ({gib(need)}, {origin}): "
            "Ray falls back to /tmp, which is slow",
            f"set docker.shm_size: {size} for this host (docker run --shm-size={size}), or lower ray.object_store_memory",
            data,
        )
    return Finding(Status.OK, f"/dev/shm {gib(have)} holds the object store ({gib(need)})", data=data)


def memory(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    mem = parse_meminfo(out)
    if "MemTotal" not in mem:
        return Finding(Status.WARN, "cannot read /proc/meminfo", "check the host")
    available = mem.get("MemAvailable", mem.get("MemFree", 0))
    store = object_store_bytes(ctx, mem["MemTotal"])
    data = {"available_bytes": available, "object_store_bytes": store}
    configured = ctx.inventory.ray.object_store_memory
    if configured and available < configured:
        return Finding(
            Status.FAIL,
            f"only {gib(available)} memory available, less than ray.object_store_memory ({gib(configured)})",
            f"free memory on {ctx.address} or lower ray.object_store_memory below {gib(available)}",
            data,
        )
    if available < store + RAY_HEADROOM:
        return Finding(
            Status.WARN,
            f"{gib(available)} memory available; the object store ({gib(store)}) plus Ray itself "
            f"(~{gib(RAY_HEADROOM)}) need {gib(store + RAY_HEADROOM)}",
            f"free memory on {ctx.address} or set ray.object_store_memory lower",
            data,
        )
    return Finding(Status.OK, f"{gib(available)} memory available (object store {gib(store)})", data=data)


def disk_view(ctx: CheckContext, results: list[CommandResult]) -> CommandResult:
    """`disk`'s input: the engine's folder and the free disk there and in /tmp (from `docker info`'s fact),
    /proc/meminfo, and the image's size (from `docker image inspect`'s), sections split by `---`."""
    engine, meminfo, image = results
    info = parse_engine(engine)
    size = parse_image(image).size
    root = info.root or dialect_for(ctx.inventory, ctx.host).default_root
    text = f"{root}\n---\n{info.df}---\n{meminfo.stdout}---\n{size if size is not None else 'absent'}\n"
    return CommandResult(0, text, "")


def disk(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    root_text, df_text, meminfo, image_size = split_sections(out, 4)
    root = root_text.strip() or dialect_for(ctx.inventory, ctx.host).default_root
    rows = {r.path: r for r in parse_df(df_text, [root, "/tmp"])}
    if root not in rows:
        return Finding(Status.WARN, f"cannot read free disk space ({err.strip()[:100]})", "check `df` on the host")
    mem = parse_meminfo(meminfo)
    spill = object_store_bytes(ctx, mem.get("MemTotal", 0))
    free_root = rows[root].available
    data: dict[str, int | None] = {"docker_root_free_bytes": free_root}
    data["tmp_free_bytes"] = rows["/tmp"].available if "/tmp" in rows else None
    size = image_size.strip()
    data["image_bytes"] = int(size) if size.isdigit() else None
    if free_root < MIN_DOCKER_ROOT_FREE:
        return Finding(
            Status.FAIL,
            f"only {gib(free_root)} free for Docker ({root}); containers and images need at least "
            f"{gib(MIN_DOCKER_ROOT_FREE)}",
            f"free space on {ctx.address}: docker system prune (or grow {rows[root].mount})",
            data,
        )
    warnings = []
    if free_root < spill + 2 * GIB:
        warnings.append(f"{gib(free_root)} free for Docker ({root}) < object store spill {gib(spill)} + 2 GiB")
    tmp = rows.get("/tmp")
    if tmp is not None and tmp.available < MIN_TMP_FREE:
        warnings.append(f"{gib(tmp.available)} free in /tmp (< {gib(MIN_TMP_FREE)})")
    if warnings:
        return Finding(Status.WARN, "; ".join(warnings), f"free disk space on {ctx.address}", data)
    tmp_note = f", {gib(tmp.available)} in /tmp" if tmp else ""
    return Finding(Status.OK, f"{gib(free_root)} free for Docker ({root}){tmp_note}", data=data)


def gpus_command(ctx: CheckContext) -> str:
    """nvidia-smi, then (Podman) the CDI specs; Docker's runtimes come from the host's one `docker info`."""
    dialect = dialect_for(ctx.inventory, ctx.host)
    support = dialect.gpu_support_command() if dialect.name == "podman" else "true"
    return (
        f'nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>&1; echo "rc=$?"; echo ---; {support}'
    )


def gpus_view(ctx: CheckContext, results: list[CommandResult]) -> CommandResult:
    """`gpus`' input: nvidia-smi, `---`, what makes GPUs reachable (Docker's runtimes or Podman's CDI specs)."""
    smi, engine = results
    if dialect_for(ctx.inventory, ctx.host).name == "podman":
        return smi
    first = split_sections(smi.stdout, 1)[0]
    return CommandResult(smi.rc, f"{first}---\n{parse_engine(engine).runtimes}\n", smi.stderr)


def gpus(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    smi, runtimes_text = split_sections(out, 2)
    wanted = ctx.host.num_gpus or 0
    lines = smi.strip().splitlines()
    smi_rc = lines[-1].removeprefix("rc=") if lines and lines[-1].startswith("rc=") else "?"
    if smi_rc == "127" or "not found" in smi:
        return Finding(
            Status.FAIL,
            f"num_gpus: {wanted} but nvidia-smi is not installed",
            f"install the NVIDIA driver on {ctx.address}, or remove num_gpus for this host",
        )
    found = parse_nvidia_smi(smi)
    data = {"gpus": len(found), "names": sorted({g.name for g in found})}
    if smi_rc != "0" and not found:
        detail = lines[0][:120] if lines else "no output"
        return Finding(Status.FAIL, f"nvidia-smi fails ({detail})", f"check the NVIDIA driver on {ctx.address}")
    if len(found) < wanted:
        return Finding(
            Status.FAIL,
            f"num_gpus: {wanted} but nvidia-smi lists {len(found)} GPU(s)",
            f"set num_gpus: {len(found)} for this host, or fix the driver",
            data,
        )
    if dialect_for(ctx.inventory, ctx.host).name == "podman":
        if "nvidia.com/gpu" not in runtimes_text:
            return Finding(
                Status.FAIL,
                "Podman has no CDI spec for nvidia.com/gpu: containers cannot see the GPUs",
                f"on {ctx.address}: nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml "
                "(and docker.run_options: ['--gpus all'] or ['--device nvidia.com/gpu=all'])",
                data,
            )
    elif "nvidia" not in parse_runtimes(runtimes_text):
        return Finding(
            Status.FAIL,
            "Docker has no nvidia runtime: containers cannot see the GPUs",
            "install nvidia-container-toolkit and run `nvidia-ctk runtime configure --runtime=docker` "
            "then restart Docker",
            data,
        )
    extra = f" (only {wanted} given to Ray)" if len(found) > wanted else ""
    means = "a CDI spec" if dialect_for(ctx.inventory, ctx.host).name == "podman" else "the nvidia runtime"
    return Finding(Status.OK, f"{len(found)} GPU(s) and {means}{extra}", data=data)


# A Ray process as parsers_runtime.is_ray_process sees one: its program is raylet or gcs_server, or it is ray::….
_RAY_AWK = "$2 ~ /(^|\\/)(raylet|gcs_server)$/ || $2 ~ /^ray::/"


def processes_command(ctx: CheckContext) -> str:
    """The Ray processes (and a line `# N processes`: ps answered), then a second look at each: gone by now (a
    short-lived worker), else its cgroup, which names its container by the container's full ID (Docker's and
    Podman's, cgroup v1 and v2). Only Ray's lines cross the wire: every process of the gather itself carries
    the whole batch script in its arguments (50 kB a host). One awk reads the cgroups, after the whole list
    (before: a `tr` per Ray process)."""
    return (
        f"ps -eo pid=,args= | awk '{{n++}} {_RAY_AWK} {{print; ray[++k] = $1}} "
        'END {if (n) print "# " n " processes"; print "---"; '
        'for (j = 1; j <= k; j++) {f = "/proc/" ray[j] "/cgroup"; s = ""; seen = 0; '
        'while ((getline line < f) > 0) {s = s line " "; seen = 1}; close(f); '
        'print ray[j] " " (seen ? s : "gone")}}\''
    )


def stale_ray_view(ctx: CheckContext, results: list[CommandResult]) -> CommandResult:
    """`stale_ray`'s input: the processes, `---`, a line `== <id> <name> <cluster label>` per running container
    (from the host's one `docker ps -a`), `---`, the Ray processes' cgroups (which place them in a container)."""
    processes, containers = results
    ps_text, cgroups = split_sections(processes.stdout, 2)
    rows = running(parse_containers(containers))
    tops = "".join(f"== {r.id} {r.name} {r.labels.get(LABEL_CLUSTER, '')}\n" for r in rows)
    return CommandResult(processes.rc, f"{ps_text}---\n{tops}---\n{cgroups}", processes.stderr)


def stale_ray(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    ps_text, tops, cgroups = split_sections(out, 3)
    if not ps_text.strip():
        return Finding(Status.WARN, f"cannot list processes ({err.strip()[:80]})", "install procps on the host")
    processes = [p for p in parse_ray_processes(ps_text, tops, cgroups) if p.container_cluster != ctx.inventory.cluster]
    if not processes:
        return Finding(Status.OK, "no other Ray on this host")
    in_containers = sorted({p.container_name for p in processes if p.container_id})
    on_host = [p for p in processes if not p.container_id]
    parts, fixes = [], []
    if in_containers:
        parts.append(f"container(s) {', '.join(in_containers)} run Ray (not this cluster's)")
        fixes.append(f"docker rm -f {' '.join(in_containers)}")
    if on_host:
        pids = ", ".join(f"{p.pid} {p.command.split()[0].rsplit('/', 1)[-1]}" for p in on_host[:5])
        parts.append(f"Ray processes on the host itself ({pids})")
        fixes.append("`ray stop --force` as their user")
    return Finding(
        Status.FAIL,
        "; ".join(parts) + ": `up` would collide with their ports and resources",
        f"on {ctx.address}: " + " and ".join(fixes) + " (if they are not needed)",
        {"pids": [p.pid for p in processes], "containers": in_containers},
    )
