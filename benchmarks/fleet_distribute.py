"""Distribute the inventory's image to all its hosts (which lack it) and print one line: mode, wall time,
bytes the operator sent (the lab bridge's tx_bytes, measured outside the program), the archive's size, and
where each host got it from. Mode `peers`: as `up` does (one seed, hosts serve hosts); `operator`: every
host streamed from this machine (OPERATOR_STREAMS at a time), as before peer copies.

Also when every host's archive was whole (the copies, from the progress events: the first that reports all its
bytes there), apart from the wall time, which ends with the last host's `docker load` and image-ID check.

Usage: fleet_distribute.py INVENTORY operator|peers BRIDGE_TX_BYTES_FILE ARCHIVE_DIR
(PYTHONPATH=<another checkout> runs that checkout's distribution: the variant peers@base of fleet.sh)
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

from raycluster_cli.config import inventory
from raycluster_cli.delivery import deliver as images
from raycluster_cli.delivery import relay
from raycluster_cli.progress import TransferProgress
from raycluster_cli.transport.pool import SSHPool


def main() -> None:
    path, mode, bridge, archive_dir = sys.argv[1:]
    inv = inventory.load(path).inventory
    image_id = images.local_image_id(inv.image)
    assert image_id, f"{inv.image} is not in this machine's engine"
    archive = images._archive(inv.image, image_id, "zstd", Path(archive_dir), lambda _: None)  # cached: not timed
    size = archive.stat().st_size
    if mode == "operator":
        # The reference: hosts that cannot receive from a peer (no bash found) are all streamed by the operator.
        relay.TOOLS_COMMAND = relay.TOOLS_COMMAND.replace(" bash timeout", "")
    plan = [images.ImageTransfer(str(h.address), "missing", "stream") for h in inv.hosts]
    pool = SSHPool(inv)
    for host in inv.hosts:
        pool(host)  # connections first: their handshakes are not the image
    whole: dict[str, float] = {}  # host -> seconds after the start when all its archive's bytes were there

    def progress(event: object) -> None:
        if (
            isinstance(event, TransferProgress)
            and event.total
            and event.sent >= event.total
            and event.host != "(compress)"
        ):
            whole.setdefault(event.host, time.monotonic() - started)

    before = int(Path(bridge).read_text())
    started = time.monotonic()
    done = images.distribute(inv, pool, plan, image_id, Path(archive_dir), progress)
    wall = time.monotonic() - started
    sent = int(Path(bridge).read_text()) - before
    pool.close()
    sources = collections.Counter("operator" if t.source.startswith("operator") else "peer" for t in done)
    for t in done:  # a host the operator served because its peer copy failed: why (one line each)
        if t.source.startswith("operator ("):
            print(f"  {t.host}: {t.source}")
    copies = f" (every archive whole at {max(whole.values()):.1f}s)" if len(whole) == len(done) else ""
    print(
        f"{mode}: {len(done)} hosts in {wall:.1f}s{copies}; operator sent {sent / 1e6:.1f} MB = {sent / size:.2f} x the "
        f"{size / 1e6:.1f} MB archive; sources {dict(sources)}"
    )


if __name__ == "__main__":
    main()
