"""The version of every JSON document raycluster writes (`--json`, the bench driver, saved results)."""

SCHEMA_VERSION = 1
