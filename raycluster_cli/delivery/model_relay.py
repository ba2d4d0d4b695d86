"""A model folder on this machine onto every host that lacks it, through the relay `up` uses for the node image:
one upload from the operator, then host to host, each copy verified whole before it is unpacked into the
host's cache (delivery/models.py, delivery/relay.py). `serve --model-path DIR` and `bench --model-path DIR` call it;
a path that is not on this machine is taken as one every node already has, as before.

A host that holds the model (its digest in its cache) is sent nothing. A changed folder is a new digest, but
only what changed travels: each host says which file contents its cache holds, and is sent a tar of only the
files it lacks (delivery/model_delta.py), verified whole like any relay copy; its unpack adds the rest from the
models it holds (hard links, the old model untouched) and checks every file of the new folder against the
manifest before the folder is named by its digest. Hosts that lack the same files are one relay.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

from raycluster_cli.config.inventory import Inventory
from raycluster_cli.delivery.model_delta import Shipment, holdings_command, parse_holdings, plan_shipments
from raycluster_cli.delivery.models import RECEIVED, ModelFolder, open_tar, read_model_folder, use_command
from raycluster_cli.delivery.relay import relay
from raycluster_cli.delivery.schedule import Delivery, Job, Receiver
from raycluster_cli.errors import OperationError
from raycluster_cli.progress import Progress, quiet
from raycluster_cli.transport import CommandResult
from raycluster_cli.transport.fanout import GroupResult, fanout
from raycluster_cli.transport.pool import Connect


@dataclass
class ModelCopy:
    """What one host needed of the model: "held" (nothing sent) or "sent" (bytes, seconds, and from where:
    "operator", the peer's address, or "operator (after …)"; how many files travelled, and how many it had in
    the models it holds and reused)."""

    host: str
    action: str
    bytes_sent: int = 0
    seconds: float = 0.0
    source: str = ""
    files_sent: int = 0
    files_reused: int = 0


def model_job(inventory: Inventory, model: ModelFolder, shipment: Shipment | None = None) -> Job:
    """The model as the relay carries it: its tar (or the tar of only the files `shipment`'s hosts lack),
    unpacked into each host's cache once verified. Hosts without python3 serve it from the node image (which
    `up` put on every host) while they unpack."""
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

    if shipment is None or shipment.whole:
        name, size, sha256, files = f"model-{model.digest}.tar", model.tar_size, model.tar_sha256, None
    else:  # a name of its own: this part is never taken for the whole model's tar
        name, size, sha256 = f"model-{model.digest}-part-{shipment.sha256[:16]}.tar", shipment.size, shipment.sha256
        files = shipment.files
    return Job(
        what=f"model {model.root.name} ({model.digest[:12]})",
        name=name,
        size=size,
        digest=sha256,
        open=lambda: open_tar(model, files),
        use=use,
        verify=verify,
        listener_image=inventory.image,
        image_on_hosts=True,
        codec="tar",
        noun="model tar",
        uses="unpacks",
    )


def _job_for(inventory: Inventory, model: ModelFolder, shipment: Shipment, _tools: object) -> Job:
    return model_job(inventory, model, shipment)


def place_model(
    inventory: Inventory, connect: Connect, model_path: str, progress: Progress = quiet
) -> tuple[str, ModelFolder | None, list[ModelCopy]]:
    """Where the nodes read the model, and what was copied for it: a folder on this machine goes into every host's
    cache where it is missing (the files each host lacks, relayed, verified there); any other path is taken as
    one that every node already has."""
    if not Path(model_path).expanduser().exists():
        return model_path, None, []
    progress(f"hashing the model folder {model_path}")
    model = read_model_folder(model_path)
    asked = fanout(
        inventory.hosts,
        lambda host: parse_holdings(connect(host).run(holdings_command(inventory, host), timeout=60).stdout),
        what="ask the hosts which models they hold",
    )
    asked.raise_failures()
    held = {str(host.address): outcome.value for host, outcome in asked if outcome.value is not None}
    sent: dict[str, tuple[Delivery, Shipment]] = {}
    for shipment in plan_shipments(model, held):
        reused = "" if shipment.whole else f" ({shipment.reused(model)} reused from the models they hold)"
        progress(
            f"{model.root.name}: {len(shipment.files)} of {len(model.files)} file(s), {shipment.size / 1e6:.1f} MB, "
            f"to {len(shipment.hosts)} host(s) that lack them{reused}"
        )
        outcomes = GroupResult(
            relay(
                inventory,
                connect,
                [Delivery(host, "missing", "stream") for host in shipment.hosts],
                partial(_job_for, inventory, model, shipment),
                progress,
            ),
            "put the model on the hosts",
        )
        outcomes.raise_failures()
        sent.update({d.host: (d, shipment) for d in outcomes.values()})
    copies = []
    for host in inventory.hosts:
        address = str(host.address)
        if address not in sent:
            copies.append(ModelCopy(address, "held"))
            continue
        done, shipment = sent[address]
        copies.append(
            ModelCopy(
                address,
                "sent",
                done.bytes_sent,
                round(done.seconds, 2),
                done.source,
                files_sent=len(shipment.files),
                files_reused=shipment.reused(model),
            )
        )
    return model.in_container, model, copies
