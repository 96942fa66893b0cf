"""Builds and loads ``script_call_sender.cpp`` (test support: the native half of a hostile peer).

The build is cached under the system's temporary folder per torch, source text, source path and
interpreter prefix, so only the first run of a checkout compiles (about half a minute on 2 cores);
``torch.utils.cpp_extension`` locks the folder while it builds. The path and prefix are in the key
because the generated build file names both: two checkouts (a clone beside a worktree) sharing
one folder rebuilt it each time the other had built last, 20-80 s inside a loaded test run.
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_suffix(".cpp")


def build_dir() -> Path:
    where = f"{SOURCE.resolve()}\0{sys.prefix}".encode()
    digest = hashlib.sha256(SOURCE.read_bytes() + b"\0" + where).hexdigest()[:16]
    tag = f"torch-{torch.__version__}-{torch.version.git_version[:10]}-{sys.implementation.cache_tag}-{digest}".replace("+", "_")
    return Path(tempfile.gettempdir()) / "rpcps-test-builds" / tag


def load() -> ModuleType:
    """Builds if needed and imports the module (the same call in the test and in the stranger)."""
    from torch.utils import cpp_extension

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name="rpcps_script_call_sender", sources=[str(SOURCE)], build_directory=str(out),
        extra_cflags=["-O1", "-DUSE_DISTRIBUTED", "-DUSE_RPC", "-DUSE_C10D"],
    )
