"""A model folder on this machine onto every host that lacks it, through the relay `up` uses for the node image:
one upload from the operator, then host to host, each copy verified whole before it is unpacked into the
host's cache (image/models.py, image/relay.py). `serve --model-path DIR` and `bench --model-path DIR` call it;
a path that is not on this machine is taken as one every node already has, as before.

A host that holds the model (its digest in its cache) is sent nothing. What changed in a folder makes a new
digest, and the whole tar travels again: copying only the files that changed is not done (yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from raycluster_cli.config.inventory import Inventory
from raycluster_cli.errors import OperationError
from raycluster_cli.image.models import (
    RECEIVED,
    ModelFolder,
    held_command,
    open_tar,
    parse_held,
    read_model_folder,
    use_command,
)
from raycluster_cli.image.relay import relay
from raycluster_cli.image.schedule import Delivery, Job, Receiver
from raycluster_cli.progress import Progress, quiet
from raycluster_cli.transport import CommandResult
from raycluster_cli.transport.fanout import GroupResult, fanout
from raycluster_cli.transport.pool import Connect


@dataclass
class ModelCopy:
    """What one host needed of the model: "held" (nothing sent) or "sent" (bytes, seconds, and from where:
    "operator", the peer's address, or "operator (after …)")."""

    host: str
    action: str
    bytes_sent: int = 0
    seconds: float = 0.0
    source: str = ""


def model_job(inventory: Inventory, model: ModelFolder) -> Job:
    """The model as the relay carries it: its tar, unpacked into each host's cache once verified. Hosts without
    python3 serve it from the node image (which `up` put on every host) while they unpack."""
    host_of = {str(h.address): h for h in inventory.hosts}

    def use(receiver: Receiver) -> str:
        return use_command(inventory, host_of[receiver.host], model)

    def verify(receiver: Receiver, result: CommandResult) -> None:
        if RECEIVED not in result.stdout.splitlines():
            raise OperationError(
                f"{receiver.host}: the model {model.root.name} ({model.digest[:12]}) was not stored: "
                f"{result.first_line() or f'exit {result.rc}'}",
                f"check free space in {receiver.host}'s host state folder, then run again",
            )

    return Job(
        what=f"model {model.root.name} ({model.digest[:12]})",
        name=f"model-{model.digest}.tar",
        size=model.tar_size,
        digest=model.tar_sha256,
        open=lambda: open_tar(model),
        use=use,
        verify=verify,
        listener_image=inventory.image,
        image_on_hosts=True,
        codec="tar",
        noun="model tar",
        uses="unpacks",
    )


def place_model(
    inventory: Inventory, connect: Connect, model_path: str, progress: Progress = quiet
) -> tuple[str, ModelFolder | None, list[ModelCopy]]:
    """Where the nodes read the model, and what was copied for it: a folder on this machine goes into every host's
    cache where it is missing (relayed, verified there); any other path is taken as one that every node already has.
    """
    if not Path(model_path).expanduser().exists():
        return model_path, None, []
    progress(f"hashing the model folder {model_path}")
    model = read_model_folder(model_path)
    held = fanout(
        inventory.hosts,
        lambda host: model.digest in parse_held(connect(host).run(held_command(inventory, host), timeout=60).stdout),
        what="ask the hosts which models they hold",
    )
    held.raise_failures()
    lacking = [Delivery(str(host.address), "missing", "stream") for host, has in held if not has.value]
    sent: dict[str, Delivery] = {}
    if lacking:
        progress(f"{model.root.name}: {model.tar_size / 1e6:.1f} MB to {len(lacking)} host(s) that lack it")
        outcomes = GroupResult(
            relay(inventory, connect, lacking, lambda _: model_job(inventory, model), progress),
            "put the model on the hosts",
        )
        outcomes.raise_failures()
        sent = {d.host: d for d in outcomes.values()}
    copies = []
    for host in inventory.hosts:
        address = str(host.address)
        done = sent.get(address)
        if done is None:
            copies.append(ModelCopy(address, "held"))
        else:
            copies.append(ModelCopy(address, "sent", done.bytes_sent, round(done.seconds, 2), done.source))
    return model.in_container, model, copies
