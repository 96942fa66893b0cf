"""The end-of-run summary every role writes with ``--summary-json``: one builder, one writer.

Every role's summary has the same core keys (``role``, ``initial_loss``, ``final_loss``, ``steps``,
``updates_applied``, ``pushes_rejected``, ``mean_staleness``, ``updates_per_second``,
``wall_seconds``) plus its own extras.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def run_summary(
    role: str,
    *,
    initial_loss: float | None,
    final_loss: float | None,
    steps: int,
    updates_applied: int,
    pushes_rejected: int,
    staleness_sum: float,
    wall_seconds: float,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "role": role,
        "initial_loss": initial_loss,
        "final_loss": final_loss,
        "steps": steps,
        "updates_applied": updates_applied,
        "pushes_rejected": pushes_rejected,
        "mean_staleness": staleness_sum / updates_applied if updates_applied else 0.0,
        "updates_per_second": updates_applied / wall_seconds if wall_seconds > 0 else 0.0,
        "wall_seconds": wall_seconds,
        **extra,
    }


def write_summary(path: str | None, summary: dict[str, Any]) -> None:
    """Writes ``summary`` atomically (a reader never sees half a file); nothing when ``path`` is None."""
    if not path:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, target)


def read_summary(path: Path) -> dict[str, Any]:
    """A summary written by ``write_summary``, or {} when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
