"""The SIGINT handler in a real process: it never waits on what the interrupted main thread holds."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# The main thread holds the SSH pool's lock (as in `up`, which opens the head's connection from it) when
# Ctrl-C arrives: the handler's snapshot of the running commands asks the pool for them.
SCRIPT = textwrap.dedent(
    """
    import os, signal
    from raycluster_cli.cli import interrupt
    from raycluster_cli.config import inventory
    from raycluster_cli.transport.pool import SSHPool

    inv = inventory.parse(
        "cluster: t\\nimage: raycluster/node:0.1.0\\nhosts:\\n  - {address: 192.0.2.1, role: head}\\n", "inv.yaml"
    )
    pool = SSHPool(inv)
    try:
        with interrupt.handled(pool.running, lambda state: os._exit(3)) as state:
            with pool._lock:
                signal.raise_signal(signal.SIGINT)
                for _ in range(10**9):
                    pass
    except KeyboardInterrupt:
        print("interrupted", state.signal, state.running, flush=True)
        os._exit(0)
    """
)


def test_ctrl_c_while_the_main_thread_holds_the_pool_lock_interrupts_at_once() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=30)
    # 3: only the last-resort timer ended it (the handler hung on the lock); a timeout: nothing did.
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout == "interrupted SIGINT []\n"
