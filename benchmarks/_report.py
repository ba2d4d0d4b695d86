"""What every benchmark script does with its JSON document: print it, and keep it in ``--out`` when given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(report: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        out.write_text(text + "\n")
