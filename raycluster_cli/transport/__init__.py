"""Reaching hosts: SSH (paramiko, every wait under a deadline, keepalive, jump hosts), the fan-out to many hosts
(GroupResult), the engine shim, tunnels, the last run's logins, and a fake from a table (tests).

May import config/ and the root modules.
"""

from raycluster_cli.transport.base import PART_SEPARATOR, CommandResult, Transport, quote, shell_path

__all__ = ["PART_SEPARATOR", "CommandResult", "Transport", "quote", "shell_path"]
