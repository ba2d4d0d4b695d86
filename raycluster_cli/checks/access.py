"""What the login user may do on a host: write the cluster's state folder, and have the engine mount it.

A non-root login is common (a user in the `docker` group, or one who may run `sudo -n docker`); these checks
prove before `up` that such a user can write the folder `up` puts the token and env files in (see
host/folders.py) and that the Docker engine can bind-mount it into the Ray container. Each finding names the
host and the fix.
"""

from __future__ import annotations

from raycluster_cli.checks.base import CheckContext, Finding, Status
from raycluster_cli.host.folders import USER_DEFAULT, cluster_dir, fix_hint, login_user, uses_sudo


def _fields(out: str) -> dict[str, str]:
    found = {}
    for line in out.splitlines():
        key, _, value = line.strip().partition(" ")
        if key:
            found[key] = value.strip()
    return found


def state_dir(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    """Judge folders.probe_command's output."""
    found = _fields(out)
    folder = cluster_dir(ctx.inventory, ctx.host)
    if "writable" not in found:
        detail = (err or out).strip().splitlines()[-1:] or [f"exit {rc}"]
        return Finding(Status.FAIL, f"cannot look at {folder} ({detail[0][:120]})", f"check the shell on {ctx.address}")
    user = found.get("user", "?").split()[0]
    resolved, at = found.get("dir", folder), found.get("at", "").split()
    where, owner_mode = (at[0], " ".join(at[1:3])) if at else ("?", "")
    data = {"user": user, "dir": resolved, "checked": where}
    expected = login_user(ctx.inventory, ctx.host)
    if user != expected and user != "?":
        hint = f"set ssh.user: {user} for this host (or host_state_dir) so that raycluster picks that user's folder"
        note = f" (the inventory names {expected}; the host says {user})"
    else:
        hint, note = fix_hint(ctx.inventory, ctx.host), ""
    if uses_sudo(ctx.inventory, ctx.host):
        if found.get("sudo") == "yes":
            return Finding(Status.OK, f"{resolved} is made with sudo -n, owned by {user}", data=data)
        return Finding(Status.FAIL, f"user {user} may not run install and rm through sudo -n{note}", hint, data)
    if found["writable"] == "yes":
        made = "writable" if where == resolved else f"can be made (in {where})"
        return Finding(Status.OK, f"{resolved} {made} by {user}", data=data)
    what = "is not writable" if where == resolved else f"cannot be made: {where} is not writable"
    return Finding(Status.FAIL, f"{resolved} {what} by {user} ({owner_mode}){note}", hint, data)


def state_mount(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    """Judge folders.mount_command's output: the engine mounted the folder into a container and listed it."""
    text = out.strip()
    if text == "root-default":
        return Finding(Status.SKIP, "root with the default folder: not checked")
    if text == "no-image":
        return Finding(Status.SKIP, "image absent: mount not checked (see the image check)")
    path = text.removeprefix("path ").strip() if text.startswith("path ") else cluster_dir(ctx.inventory, ctx.host)
    if rc == 0 and text.startswith("path "):
        return Finding(Status.OK, f"the engine mounts {path} into the Ray container", data={"path": path})
    detail = (err or out).strip().splitlines()[-1:] or [f"exit {rc}"]
    return Finding(
        Status.FAIL,
        f"the engine cannot mount {path} into the Ray container ({detail[0][:160]})",
        f"set host_state_dir to a local folder of {ctx.address} that the Docker daemon can read "
        f"(not an NFS home with root_squash; e.g. /var/lib/raycluster with ssh.sudo: true, or {USER_DEFAULT} "
        "on a local disk)",
        {"path": path},
    )
