"""raycluster: a Ray cluster in Docker on your own machines, checked first and proven balanced.

Two sides, each a stack of folders whose arrows only point down (docs/ARCHITECTURE.md draws both):
- the operator side, on the user's machine: cli → render → verbs → delivery, checks → host → transport → config;
- the node side, in the node image: bench/ and serve/ (never importing each other) → diffusion/ → node/ →
  placement/ → models/. placement/ is pure Python, so the operator imports it too.
The modules at this root (errors, progress, cancel, schema, versions, apikeys) import none of them. startup.py holds the
stand-ins that keep two slow imports out of every verb's start.
"""

from raycluster_cli.startup import defer_metadata

__version__ = "0.1.0"
__all__ = ["__version__", "defer_metadata"]
