"""Where raycluster keeps a cluster's files on each host (Ray token, env files), and how it may write there.

The folder is `<host_state_dir>/<cluster>`. `host_state_dir` comes from the inventory, else it depends on
the host's login user (the inventory's `ssh.user`, else `~/.ssh/config`'s `User`, as the pool logs in): root, or any user with `ssh.sudo: true`, keeps `/etc/raycluster`
(the folder is then made with `sudo -n install -d -o <user> -m 700`, so the files in it belong to the login
user); any other user gets `~/.local/state/raycluster` in its own home, which needs no privilege at all.
A path starting with `~/` is expanded by the host's shell (`"$HOME"/…`), so the home is the login user's
own on each host. The token and env files are written by the login user, mode 0600, from stdin.

The folder is chmod-ed when `up` makes it and `rm -rf`-ed (through sudo with `ssh.sudo`) by `down --purge`, so
raycluster claims only a folder it made: `up` writes a marker file in it (`MARKER`, naming the cluster), and
both refuse a folder that is a link or a file, belongs to another user, or lacks the marker (issue 34, item 9).
A folder made before the marker existed is adopted when it belongs to the login user and holds nothing but
names raycluster writes (`OURS`): `up` marks it, `down --purge` removes it. The refusal is one line starting
`raycluster-refused:` (`refusal`), which `up` and `down` report with the host, the path and the fix.
"""

from __future__ import annotations

import functools

import paramiko

from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.errors import OperationError
from raycluster_cli.transport import Transport, quote, shell_path
from raycluster_cli.transport.sshconfig import load_config, resolve

# On the hosts: image archives kept to serve other hosts, removed after. A login user other than root gets its own
# folder (`ARCHIVE_DIR-<user>`, see archive_dir): one made 0700 by root would refuse it.
ARCHIVE_DIR = "/var/tmp/raycluster-images"

ROOT_DEFAULT = "/etc/raycluster"
USER_DEFAULT = "~/.local/state/raycluster"
SUDO = "sudo -n"
MARKER = ".raycluster-cluster"  # in the cluster's folder, holding `raycluster cluster <name>`
OURS = ("auth-token", "head.env", "worker.env", "models", MARKER)  # what raycluster writes in the folder
REFUSED = "raycluster-refused:"


@functools.lru_cache(maxsize=8)
def _ssh_config(path: str | None) -> paramiko.SSHConfig:
    return load_config(path)


def login_user(inventory: Inventory, host: HostConfig) -> str:
    """The user raycluster logs in as on `host`, resolved as the connection pool does: the inventory's
    `ssh.user` when it sets one, else `~/.ssh/config`'s `User` for that host, else the default (root)."""
    return resolve(inventory, host, _ssh_config(inventory.ssh.config_file)).target.user


def state_root(inventory: Inventory, host: HostConfig) -> str:
    """The folder on `host` under which every cluster's folder lives (see the module's docstring)."""
    if inventory.host_state_dir:
        return inventory.host_state_dir
    ssh = inventory.ssh_for(host)
    return ROOT_DEFAULT if login_user(inventory, host) == "root" or ssh.sudo else USER_DEFAULT


def cluster_dir(inventory: Inventory, host: HostConfig) -> str:
    """This cluster's folder on `host` (token, env files); only `down --purge` removes it."""
    return f"{state_root(inventory, host)}/{inventory.cluster}"


def models_dir(inventory: Inventory, host: HostConfig) -> str:
    """The host's model cache (delivery/models.py), inside the cluster's private folder: `up` mounts it read-only
    into the Ray container; `down --purge` removes it with the folder."""
    return f"{cluster_dir(inventory, host)}/models"


def archive_dir(inventory: Inventory, host: HostConfig) -> str:
    """Where `host` keeps image archives while serving peers: root's shared folder, else the login user's own
    (a folder root made 0700 there would refuse another user)."""
    user = login_user(inventory, host)
    return ARCHIVE_DIR if user == "root" else f"{ARCHIVE_DIR}-{user}"


def uses_sudo(inventory: Inventory, host: HostConfig) -> bool:
    """Whether making and removing the folder goes through `sudo -n` (never for root or a home folder)."""
    ssh = inventory.ssh_for(host)
    return ssh.sudo and login_user(inventory, host) != "root" and not state_root(inventory, host).startswith("~/")


def _tag(inventory: Inventory) -> str:
    return f"raycluster cluster {inventory.cluster}"


def claim_check(inventory: Inventory, host: HostConfig) -> str:
    """Shell text (a subshell): succeeds when the cluster's folder is absent or raycluster's (see the module's
    docstring); else prints one line `raycluster-refused: REASON` on stderr and fails. Changes nothing."""
    folder = shell_path(cluster_dir(inventory, host))
    names = "|".join(quote(name) for name in OURS)
    refuse = f'{{ echo "{REFUSED} '
    return (
        f"( f={folder}; "
        f'if [ -L "$f" ] || {{ [ -e "$f" ] && [ ! -d "$f" ]; }}; then {refuse}it is a link or a file, not a folder" >&2; exit 3; }}; fi; '
        '[ -d "$f" ] || exit 0; '
        f'[ -O "$f" ] || {refuse}it belongs to $(stat -c %U "$f" 2>/dev/null), not to $(id -un)" >&2; exit 3; }}; '
        f'if [ -f "$f"/{MARKER} ]; then [ "$(head -c 200 "$f"/{MARKER})" = {quote(_tag(inventory))} ] '
        f'|| {refuse}its {MARKER} names another cluster" >&2; exit 3; }}; exit 0; fi; '
        'for e in "$f"/* "$f"/.[!.]* "$f"/..?*; do { [ -e "$e" ] || [ -L "$e" ]; } || continue; '
        f'case "${{e##*/}}" in {names}|*.raycluster-tmp) ;; '
        f'*) {refuse}it holds ${{e##*/}}, which raycluster does not write, and no {MARKER}" >&2; exit 3; }};; esac; done )'
    )


def refusal(inventory: Inventory, host: HostConfig, text: str, doing: str) -> OperationError | None:
    """The error for a `claim_check` refusal found in a command's output (None: no refusal there)."""
    for line in text.splitlines():
        if line.startswith(REFUSED):
            folder = cluster_dir(inventory, host)
            return OperationError(
                f"{host.address}: {folder} is not raycluster's folder, so {doing}: {line[len(REFUSED) :].strip()}",
                f"on {host.address}, move {folder} aside (or remove it, if it is a leftover of raycluster's), "
                "or set host_state_dir to another folder",
            )
    return None


def make_dir_command(inventory: Inventory, host: HostConfig) -> str:
    """Make the cluster's folder, mode 0700, owned by the login user; the folder above it 0755.

    Only the cluster's folder is private: a parent made 0700 by root (as `mkdir -p` under `umask 077`
    did before) cannot be crossed by another login, so a sudo user's `up` failed on a host where root's
    had run. The sudo path also repairs such a parent (only when this login cannot cross it)."""
    folder = shell_path(cluster_dir(inventory, host))
    parent = shell_path(state_root(inventory, host))
    mark = f"{{ [ -f {folder}/{MARKER} ] || echo {quote(_tag(inventory))} > {folder}/{MARKER}; }}"
    if uses_sudo(inventory, host):
        return (
            f"{claim_check(inventory, host)} && {{ [ -x {parent} ] || {SUDO} install -d -m 755 {parent}; }} && "
            f'{SUDO} install -d -m 700 -o "$(id -un)" -g "$(id -gn)" {folder} && {mark}'
        )
    return (
        f"{claim_check(inventory, host)} && (umask 022 && mkdir -p -- {parent}) && umask 077 && "
        f"mkdir -p -- {folder} && chmod 700 {folder} && {mark}"
    )


def remove_dir_command(inventory: Inventory, host: HostConfig) -> str:
    """Remove the cluster's folder if it is there and raycluster's (claim_check); prints `removed` when it was."""
    folder = shell_path(cluster_dir(inventory, host))
    sudo = f"{SUDO} " if uses_sudo(inventory, host) else ""
    return (
        f"if [ -e {folder} ] || [ -L {folder} ]; then {claim_check(inventory, host)} && "
        f"{sudo}rm -rf -- {folder} && echo removed; fi"
    )


def make_dir(transport: Transport, inventory: Inventory, host: HostConfig) -> None:
    result = transport.run(make_dir_command(inventory, host), timeout=60)
    refused = refusal(inventory, host, result.stderr, "raycluster will not use it")
    if refused is not None:
        raise refused
    if not result.ok:
        raise OperationError(
            f"{host.address}: cannot create {cluster_dir(inventory, host)} as {login_user(inventory, host)}: "
            f"{result.first_line()}",
            fix_hint(inventory, host),
        )


def fix_hint(inventory: Inventory, host: HostConfig) -> str:
    """How to give the login user a folder it may write (the doctor check and `up` say the same)."""
    user, folder = login_user(inventory, host), cluster_dir(inventory, host)
    if uses_sudo(inventory, host):
        return (
            f"on {host.address}, let {user} run install and rm through sudo without a password (sudoers: "
            f"{user} ALL=(root) NOPASSWD: /usr/bin/install, /usr/bin/rm), or set host_state_dir: {USER_DEFAULT}"
        )
    return (
        f"set host_state_dir: {USER_DEFAULT} (the login user's home), or ssh.sudo: true, or as root on "
        f"{host.address}: install -d -o {user} -m 700 {folder}"
    )


def _nearest_existing(folder: str) -> str:
    """Shell text that sets $p to `folder`, or its nearest existing parent when it does not exist yet."""
    return (
        f'd={folder}; p=$d; while [ ! -e "$p" ] && [ "$p" != / ]; do '
        "case $p in */*) q=${p%/*}; p=${q:-/};; *) p=.;; esac; done; "  # dirname, without a process a level
    )


def probe_command(inventory: Inventory, host: HostConfig) -> str:
    """Doctor's fact: who logs in, the folder, whether it (or the parent it would be made in) is writable,
    and whether sudo may make it. Lines `key value…`; read-only."""
    folder = cluster_dir(inventory, host)
    sudo = (
        f"if {SUDO} -l install >/dev/null 2>&1 && {SUDO} -l rm >/dev/null 2>&1; "
        "then echo sudo yes; else echo sudo no; fi"
        if uses_sudo(inventory, host)
        else "echo sudo unused"
    )
    return (
        'echo "user $(id -un) ${EUID:-$(id -u)}"; '  # bash knows the user ID without a process
        + _nearest_existing(shell_path(folder))
        + 'echo "dir $d"; echo "at $p $(stat -c \'%U %a %F\' "$p" 2>/dev/null)"; '
        'if [ -d "$p" ] && [ -w "$p" ] && [ -x "$p" ]; then echo writable yes; else echo writable no; fi; ' + sudo
    )


def mount_command(inventory: Inventory, host: HostConfig) -> str:
    """Doctor's fact: the engine bind-mounts the folder (or the parent it will be made in) into a container of
    the node image, as `up` will, and lists it there. Skipped for root with the default folder."""
    folder = cluster_dir(inventory, host)
    image = quote(inventory.image)
    run = (
        "docker run --rm --network=none --log-driver=none --entrypoint=ls "
        f'--volume="$p":/mnt/raycluster-state:ro {image} /mnt/raycluster-state'
    )
    default = f"{ROOT_DEFAULT}/{inventory.cluster}"
    return (
        _nearest_existing(shell_path(folder))
        + f'if [ "$(id -u)" = 0 ] && [ "$d" = {quote(default)} ]; then echo root-default; exit 0; fi; '
        f"docker image inspect {image} >/dev/null 2>&1 || {{ echo no-image; exit 0; }}; "
        f'echo "path $p"; {run} >/dev/null'
    )
