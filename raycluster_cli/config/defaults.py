"""The defaults the CLI's flags show for verbs whose modules it imports only when they run (lab, logs).

Typer needs a flag's default when the CLI is defined, so these live apart from lab.py and logs.py (which
re-export them): importing the CLI for `doctor` or `status` then loads neither.
"""

from __future__ import annotations

import os

# Several labs can live side by side on one machine (for example one per test session): each has its
# own name (container-name prefix, network name and label value), subnet and node image.
LAB_NAME = os.environ.get("RAYCLUSTER_LAB_NAME", "raycluster-lab")
DEFAULT_SUBNET = os.environ.get("RAYCLUSTER_LAB_SUBNET", "10.77.0.0/24")
NODE_IMAGE = os.environ.get("RAYCLUSTER_NODE_IMAGE", "raycluster/node:0.1.0")
MAX_HOSTS = 200  # lab hosts

DEFAULT_MAX_MIB = 100  # logs: the bundle's cap
DEFAULT_TIMEOUT_S = 300.0  # logs: the collection's deadline
