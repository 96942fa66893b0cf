"""Writes the end-of-run ``--summary-json`` file atomically (a reader never sees half a file)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_summary(path: str | None, summary: dict[str, Any]) -> None:
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, target)
