"""`lab up` / `lab down`: the local Docker-in-Docker lab."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from raycluster_cli.cli.common import DebugOpt, JsonOpt, execute
from raycluster_cli.config.defaults import (
    DEFAULT_SUBNET,
    LAB_NAME,
    MAX_HOSTS,
    NODE_IMAGE,
)
from raycluster_cli.errors import ExitCode, RayclusterError
from raycluster_cli.render.base import (
    Output,
    render_lab,
)


def lab_up_command(
    hosts: Annotated[int, typer.Option("--hosts", min=1, max=MAX_HOSTS, help="how many lab hosts")] = 3,
    lab_dir: Annotated[Path | None, typer.Option("--dir", help="where the lab keeps its key and inventory")] = None,
    subnet: Annotated[str, typer.Option(help="the lab network's IPv4 subnet")] = DEFAULT_SUBNET,
    image: Annotated[str, typer.Option(help="node image to load into every lab host")] = NODE_IMAGE,
    name: Annotated[str, typer.Option(help="the lab's name (container prefix, network, label)")] = LAB_NAME,
    node_image: Annotated[
        bool, typer.Option("--node-image/--no-node-image", help="load the node image into the hosts (fleet labs: no)")
    ] = True,
    cpus: Annotated[
        list[str] | None, typer.Option(help="CPU quota of a host's Ray container, HOSTNAME=CPUS (repeatable)")
    ] = None,
    cpu_quotas: Annotated[
        str | None, typer.Option(help="CPU quotas of the hosts' Ray containers in order, e.g. 1.0,0.5,0.25")
    ] = None,
    engine: Annotated[str, typer.Option(help="the container engine in the hosts: docker or podman")] = "docker",
    json_mode: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Start N lab hosts (sshd + dockerd, or podman, each), load the node image, write their inventory."""

    def action(output: Output) -> int:
        from raycluster_cli.lab import hosts as lab

        options = lab.quota_options(cpu_quotas, hosts) if cpu_quotas else {}
        for item in cpus or []:
            hostname, sep, value = item.partition("=")
            if not sep:
                raise RayclusterError(f"--cpus {item!r} is not HOSTNAME=CPUS", "e.g. --cpus lab-h2=0.5")
            options[hostname] = lab.cpu_options(value, "--cpus")
        info = lab.lab_up(
            hosts,
            lab_dir=lab_dir,
            node_image=image,
            subnet=subnet,
            name=name,
            load_node_image=node_image,
            host_options=options,
            engine=engine,
            progress=output.progress(),
        )
        if json_mode:
            output.document(True, info.to_dict())
        else:
            render_lab(output, info.to_dict())
            print(info.inventory_path, file=sys.stderr)
        return ExitCode.OK

    execute(json_mode, debug, action)


def lab_down_command(
    lab_dir: Annotated[Path | None, typer.Option("--dir", help="the lab's folder")] = None,
    keep_volumes: Annotated[bool, typer.Option(help="keep the hosts' Docker volumes (images) for next time")] = False,
    name: Annotated[str, typer.Option(help="the lab's name (container prefix, network, label)")] = LAB_NAME,
    json_mode: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Remove every lab host, the lab network and (unless kept) their volumes."""

    def action(output: Output) -> int:
        from raycluster_cli.lab import hosts as lab

        removed = lab.lab_down(lab_dir=lab_dir, keep_volumes=keep_volumes, name=name, progress=output.progress())
        if json_mode:
            output.document(True, {"removed": removed})
        else:
            render_lab(output, {"removed": removed})
        return ExitCode.OK

    execute(json_mode, debug, action)
