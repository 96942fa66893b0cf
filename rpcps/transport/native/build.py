"""Compiles ``request_filter.cpp`` against the installed torch: ``python -m rpcps.transport.native``.

``tools/setup.sh`` and the Docker image run this once per environment; it needs a C++ compiler and
ninja (``torch.utils.cpp_extension``). Each build lands in a folder named after what it was built
for (torch's version and git commit, the Python ABI, the source's digest), so the loader
(``rpcps.transport.request_filter``) finds the one that fits or says to run this again: a build for
another torch would load private headers' layouts that no longer match.

What must not live here: loading the module in a serving process (``request_filter`` does that,
and never builds: a process must not start compiling, or run without the filter, by surprise).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "request_filter.cpp"
MODULE_NAME = "rpcps_request_filter"
BUILD_ROOT = HERE / "_build"
"""Git-ignored; one folder per (torch, Python, source) combination."""
COMMAND = f"{Path(sys.executable).name} -m rpcps.transport.native"
"""What to run when the build is missing or stale (the loader's error names it)."""

logger = logging.getLogger(__name__)


def torch_identity() -> str:
    """The torch this process runs: version (with its local tag, e.g. +cpu, +cu126) and git commit."""
    return f"{torch.__version__} {torch.version.git_version}"


def source_digest() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def build_dir() -> Path:
    """Where the build for this torch, this Python and this source lives."""
    tag = f"torch-{torch.__version__}-{torch.version.git_version[:10]}-{sys.implementation.cache_tag}-{source_digest()}"
    return BUILD_ROOT / tag.replace("+", "_")


def library_path() -> Path:
    return build_dir() / f"{MODULE_NAME}.so"


def build(verbose: bool = False) -> ModuleType:
    """Compiles (ninja skips what is up to date) and imports the module; returns it.

    Raises:
        RuntimeError, OSError, subprocess.CalledProcessError: no compiler, no ninja, a compile error.
    """
    from torch.utils import cpp_extension  # slow to import; only the build needs it

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    info = out / "rpcps_build_info.h"
    text = (
        "// Written by rpcps/transport/native/build.py; read by request_filter.cpp.\n"
        f'#define RPCPS_TORCH_VERSION "{torch_identity()}"\n'
        f'#define RPCPS_SOURCE_DIGEST "{source_digest()}"\n'
    )
    if not info.exists() or info.read_text() != text:
        info.write_text(text)
    return cpp_extension.load(
        name=MODULE_NAME,
        sources=[str(SOURCE)],
        extra_cflags=["-O2", "-DUSE_TENSORPIPE", "-DUSE_DISTRIBUTED", "-DUSE_RPC", "-DUSE_C10D"],
        extra_include_paths=[str(out)],
        build_directory=str(out),
        verbose=verbose,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        module = build(verbose=args.verbose)
    except Exception as e:  # noqa: BLE001 - one line for setup.sh's log, whatever the toolchain said
        print(f"could not build rpcps's RPC request filter: {e}\n(it needs g++ and ninja; Debian: apt-get install g++ ninja-build)",
              file=sys.stderr)
        return 1
    print(f"built rpcps's RPC request filter for torch {module.built_for} in {time.monotonic() - started:.1f}s: {library_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
