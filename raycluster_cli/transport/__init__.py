"""Ways to run commands on a host: over SSH (paramiko), or from a table (tests)."""

from .base import CommandResult, Transport, quote, shell_path

__all__ = ["CommandResult", "Transport", "quote", "shell_path"]
