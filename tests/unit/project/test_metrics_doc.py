"""docs/METRICS.md documents every metric rpcps exposes, under the name a person queries."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tools"))  # a script in the checkout, not an installed module
import check_dashboard as cd


def test_every_metric_has_a_row_in_metrics_md() -> None:
    doc = (REPO / "docs" / "METRICS.md").read_text()
    names = [cd.exposed_name(f) for f in cd.rpcps_families()]
    assert "rpcps_server_updates_applied_total" in names  # the catalogue itself is not empty or misnamed
    missing = [n for n in names if f"| `{n}` |" not in doc]
    assert missing == [], f"add a row for each to docs/METRICS.md (name, type, labels, meaning): {missing}"
