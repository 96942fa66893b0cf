"""The committed generated control-plane code matches ps/control/control.proto."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
def test_generated_code_is_up_to_date() -> None:
    result = subprocess.run(
        [str(ROOT / "tools" / "check_proto_drift.sh")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    if result.returncode == 3:
        pytest.skip(result.stderr.strip())
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_grpc_code_imports_package_qualified() -> None:
    text = (ROOT / "ps" / "control" / "control_pb2_grpc.py").read_text()
    assert "from ps.control import control_pb2" in text
    import ps.control.control_pb2_grpc  # noqa: F401  (fails if the import were top-level `control_pb2`)
