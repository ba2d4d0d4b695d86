"""raycluster: a Ray cluster in Docker on your own machines, checked first and proven balanced."""

__version__ = "0.1.0"
