"""Reading a `doctor --json` document in lab tests: which checks failed or warned, and where."""

from __future__ import annotations

from typing import Any


def failed(doc: dict[str, Any]) -> list[tuple[str, str]]:
    return sorted((c["host"], c["id"]) for c in doc["checks"] if c["status"] == "fail")


def warned(doc: dict[str, Any]) -> list[tuple[str, str]]:
    return sorted((c["host"], c["id"]) for c in doc["checks"] if c["status"] == "warn")


def problems(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in doc["checks"] if c["status"] in ("warn", "fail")]


def finding(doc: dict[str, Any], host: str, check: str) -> dict[str, Any]:
    return next(c for c in doc["checks"] if c["host"] == host and c["id"] == check)
