"""A trained model's ``state_dict`` as a file anyone can load without rpcps.

Two formats:

- ``torch``: ``torch.save`` of the plain dict, loadable with
  ``model.load_state_dict(torch.load(path, weights_only=True))`` (no code runs at load).
- ``safetensors``: the safetensors format (no pickle at all; memory-mapped loading, readable from
  other frameworks), with the optional ``safetensors`` package (``pip install rpcps[safetensors]``).

``auto`` picks safetensors for a ``.safetensors`` path and torch otherwise. Files are written under a
temporary name, fsynced and renamed into place, so a reader (or a crash) never sees half a model.
The file holds the state_dict and nothing else: extra keys would break ``load_state_dict``'s strict
check, so what rpcps knows about it (versions, source) is returned to the caller, not stored in it.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FORMATS = ("auto", "torch", "safetensors")


def resolve_format(path: str | Path, fmt: str = "auto") -> str:
    """``torch`` or ``safetensors`` for writing ``path`` as ``fmt`` asks; raises ValueError."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {fmt!r}")
    if fmt == "auto":
        return "safetensors" if str(path).endswith(".safetensors") else "torch"
    return fmt


def to_bytes(state: dict[str, torch.Tensor], fmt: str) -> bytes:
    """The file's content for ``state`` in ``fmt`` (``torch`` or ``safetensors``)."""
    # Tensors of a state_dict may be views into a larger storage; torch.save would write all of it,
    # safetensors refuses shared storage. Contiguous CPU copies hold exactly what the model holds.
    import torch  # here, not at the top: ``rpcps ctl`` writes files it got as bytes and never loads torch

    state = {name: t.detach().to("cpu").contiguous().clone() for name, t in state.items()}
    if fmt == "safetensors":
        return _safetensors().save(state, metadata={"format": "pt"})
    if fmt != "torch":
        raise ValueError(f"format must be torch or safetensors, got {fmt!r}")
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def write_bytes(data: bytes, path: str | Path) -> None:
    """Writes ``data`` to ``path`` so that it appears whole or not at all."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: str | Path) -> None:
    """Makes the names in directory ``path`` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_state_dict(state: dict[str, torch.Tensor], path: str | Path, fmt: str = "auto") -> int:
    """Writes ``state`` to ``path``; returns the file's size in bytes. Raises OSError, ValueError."""
    data = to_bytes(state, resolve_format(path, fmt))
    write_bytes(data, path)
    return len(data)


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Reads a file written by ``save_state_dict`` (either format, told apart by its content)."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head.startswith(b"PK"):  # torch.save writes a zip archive
        import torch

        return torch.load(path, map_location="cpu", weights_only=True)
    return _safetensors().load_file(str(path))


def _safetensors() -> ModuleType:
    try:
        import safetensors.torch
    except ImportError:
        raise ValueError("the safetensors format needs the safetensors package: pip install 'rpcps[safetensors]'") from None
    return safetensors.torch
