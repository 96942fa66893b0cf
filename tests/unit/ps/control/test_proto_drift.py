"""The committed generated code matches its .proto: the control plane (ps/control/) and the etcd client (rpcps/etcd/)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]


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
    assert "from rpcps.etcd import rpc_pb2" in (ROOT / "rpcps" / "etcd" / "rpc_pb2_grpc.py").read_text()
    import rpcps.etcd.rpc_pb2_grpc  # noqa: F401


def test_the_test_extras_pin_the_grpcio_tools_that_generated_the_committed_code() -> None:
    """CI installs the test extras; with another grpcio-tools the drift check above could only skip."""
    code = (ROOT / "ps/control/control_pb2_grpc.py").read_text()
    generated = re.search(r"^GRPC_GENERATED_VERSION = '(.+)'$", code, re.MULTILINE)
    assert generated is not None
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert f"grpcio-tools=={generated.group(1)}" in extras, "bump the pin in pyproject.toml's test extras with tools/gen_proto.sh"
