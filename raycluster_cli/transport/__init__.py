"""Ways to run commands on a host: over SSH (paramiko), or from a table (tests)."""

from .base import PART_SEPARATOR, CommandResult, Transport, quote, shell_path

__all__ = ["PART_SEPARATOR", "CommandResult", "Transport", "quote", "shell_path"]
