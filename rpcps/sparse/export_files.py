"""The export of a model with sparse tables: a directory anyone reads without rpcps, written atomically.

Layout (``rpcps export`` of a checkpoint, ``rpcps ctl export`` of a live server)::

    OUT/
      model.pt | model.safetensors          the dense state_dict (rpcps.model_file, as a dense-only export)
      tables/NAME.00000.pt | .safetensors   per table, parts of at most ``part_rows`` rows, each
                                            {"ids": int64 [n], "weight": float32 [n, dim]
                                             (, "state": float32 [n, state_width] on request)}
      export.json                           the manifest, written last: the directory is an export
                                            only when it is there

Parts bound the memory of writing and reading (one part at a time) and are each loadable with
``torch.load(path, weights_only=True)`` or ``safetensors.torch.load_file``. Ids are unique across a
table's parts, in no particular order. The manifest names, per table, its id, width, row count, the
optimizer the state columns belong to, how ids absent from the export read (``unseen``: ``init``
is the deterministic initial row of ``rpcps.sparse.row_init`` with the manifest's ``init``
settings, ``zeros`` is zeros), and each part's size and SHA-256.

Writing: every file goes into ``.OUT.tmp-PID`` next to ``OUT`` (fsynced), the manifest last, then
that directory is renamed to ``OUT``. An ``OUT`` that already holds an export is moved aside first
and deleted after; anything else at ``OUT`` is refused. A reader sees the old export, the new one,
or (between the two renames) none, never half of one.

Importing this module does not load torch (``rpcps ctl export`` writes a server's export with it).
What must not live here: where the rows come from (``ps.checkpoints.sparse_export``) and looking them up
(``rpcps.sparse.serving``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

from rpcps.model_file import fsync_dir, load_state_dict, resolve_format, to_bytes

if TYPE_CHECKING:
    import torch

FORMAT = "rpcps-export-v1"
MANIFEST = "export.json"
TABLES_DIR = "tables"
DEFAULT_PART_ROWS = 1 << 20
"""Rows per part file: 72 MiB at dim 16 (ids and weights)."""
SUFFIX = {"torch": ".pt", "safetensors": ".safetensors"}


class ExportFormatError(ValueError):
    """A directory that is not a usable export (the message says why and what to do)."""


def directory_format(fmt: str) -> str:
    """``torch`` or ``safetensors`` for an export directory (``auto`` is torch: a directory has no suffix)."""
    return "torch" if fmt == "auto" else resolve_format("", fmt)


def dense_name(fmt: str) -> str:
    return f"model{SUFFIX[fmt]}"


def part_name(table: str, index: int, fmt: str) -> str:
    return f"{TABLES_DIR}/{table}.{index:05d}{SUFFIX[fmt]}"


def check_out(out: str | Path) -> Path:
    """``out`` as an export directory path; raises ExportFormatError when it names a file."""
    out = Path(out)
    if out.suffix in SUFFIX.values():
        raise ExportFormatError(
            f"--out {out} names a file, but this model has sparse tables: their export is a directory (the dense "
            "state_dict plus each table's ids and rows); pass a directory path, e.g. --out /tmp/model-export"
        )
    if out.exists() and not out.is_dir():
        raise ExportFormatError(f"--out {out} is an existing file; pass a new directory path")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise ExportFormatError(f"--out {out} is a directory that holds something other than an export; pass a new path")
    return out


class PartFile:
    """One part file of a table, serialised only as it is written: ``write`` puts the tensors
    straight into the file (no copy of them in memory), ``data`` gives its bytes (for a stream).
    Either fills the part's manifest entry (``bytes``, ``sha256``). Its tensors are the collecting
    buffers, valid until the next part is asked for: write or serialise it before that."""

    def __init__(self, path: str, tensors: dict[str, torch.Tensor], fmt: str, entry: dict[str, Any]) -> None:
        self.path, self.tensors, self.fmt, self.entry = path, tensors, fmt, entry

    def write(self, file: Path) -> int:
        """Writes the file (fsynced); returns its size."""
        import torch
        from torch.utils.serialization.config import save as save_config

        if self.fmt == "torch":
            # torch's own writer, records straight from the tensors, without the zip CRC-32 (a third
            # of the time; torch.load does not check it, and the manifest's SHA-256 covers the file).
            # The switch is process-wide: no other thread of an export saves meanwhile.
            crc, save_config.compute_crc32 = save_config.compute_crc32, False
            try:
                torch.save(self.tensors, str(file))
            finally:
                save_config.compute_crc32 = crc
            with open(file, "rb+") as f:
                os.fsync(f.fileno())
        else:
            with open(file, "wb") as f:
                _write_safetensors(f, self.tensors)
                f.flush()
                os.fsync(f.fileno())
        with open(file, "rb") as f:  # hashed from the page cache the write just filled
            self.entry.update(bytes=os.fstat(f.fileno()).st_size, sha256=hashlib.file_digest(f, "sha256").hexdigest())
        return int(self.entry["bytes"])

    def data(self) -> bytes:
        data = to_bytes(self.tensors, self.fmt)
        self.entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        return data


def _write_safetensors(f: IO[bytes], tensors: dict[str, torch.Tensor]) -> None:
    """The safetensors format (an 8-byte header length, a JSON header, then the raw little-endian
    bytes) written from the tensors' memory, in order; ``safetensors.torch.load_file`` reads it."""
    import torch

    names = {torch.int64: "I64", torch.float32: "F32"}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors' own writer does
    f.write(len(text).to_bytes(8, "little") + text)
    for t in tensors.values():
        f.write(t.contiguous().numpy().data)


class TableParts:
    """Collects a table's rows, slice by slice, into part files of ``part_rows`` rows.

    ``add`` takes rows ``[n, width]`` (embedding, then optimizer state) and gives the parts that
    filled; ``finish`` the last one. One part's rows are held at a time (in buffers of exactly that
    many rows, which the parts' tensors are: see PartFile).
    """

    def __init__(self, name: str, dim: int, width: int, fmt: str, part_rows: int = DEFAULT_PART_ROWS,
                 with_state: bool = False) -> None:
        import torch  # here, not at the top: ``rpcps ctl`` writes exports it got as bytes and never loads torch

        if part_rows < 1:
            raise ValueError(f"part_rows must be >= 1, got {part_rows}")
        self.name, self.dim, self.width, self.fmt, self.part_rows = name, dim, width, fmt, part_rows
        self.rows = 0
        self.parts: list[dict[str, Any]] = []
        self._buffers = {"ids": torch.empty(part_rows, dtype=torch.int64), "weight": torch.empty(part_rows, dim)}
        if with_state and width > dim:
            self._buffers["state"] = torch.empty(part_rows, width - dim)
        self._filled = 0

    def add(self, ids: torch.Tensor, rows: torch.Tensor) -> Iterator[PartFile]:
        done = 0
        while done < ids.numel():
            take = min(ids.numel() - done, self.part_rows - self._filled)
            at, src = slice(self._filled, self._filled + take), slice(done, done + take)
            self._buffers["ids"][at] = ids[src]
            self._buffers["weight"][at] = rows[src, : self.dim]
            if "state" in self._buffers:
                self._buffers["state"][at] = rows[src, self.dim :]
            self._filled += take
            done += take
            if self._filled == self.part_rows:
                yield self._flush()

    def finish(self) -> Iterator[PartFile]:
        """The last, partly filled part (none when the table ended on a part boundary, unless it is empty)."""
        if self._filled or not self.parts:
            yield self._flush()

    def _flush(self) -> PartFile:
        n = self._filled
        # A full part is the buffers themselves; a short one (the last) is copied: a view would
        # carry the whole buffer into torch.save.
        tensors = {k: b if n == self.part_rows else b[:n].clone() for k, b in self._buffers.items()}
        entry = {"file": part_name(self.name, len(self.parts), self.fmt), "rows": n}
        self.parts.append(entry)
        self.rows += n
        self._filled = 0
        return PartFile(cast(str, entry["file"]), tensors, self.fmt, entry)


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return json.dumps({"format": FORMAT, **manifest}, indent=1, sort_keys=True).encode()


def dense_file(state: dict[str, torch.Tensor], fmt: str) -> tuple[str, bytes]:
    return dense_name(fmt), to_bytes(state, fmt)


def write_export(files: Iterable[tuple[str, bytes | PartFile]], out: str | Path) -> int:
    """Writes ``(relative path, bytes or PartFile)`` pairs as the directory ``out``, atomically
    (module docstring), each before asking for the next.

    The last pair must be the manifest (``export.json``). Returns the bytes written.
    Raises ExportFormatError (``out`` holds something else; no manifest last) and OSError.
    """
    out = check_out(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    total, last = 0, ""
    try:
        (tmp / TABLES_DIR).mkdir(parents=True)
        for relative, data in files:
            if isinstance(data, PartFile):
                total += data.write(tmp / relative)
            else:
                _write_synced(tmp / relative, data)
                total += len(data)
            last = relative
        if last != MANIFEST:
            raise ExportFormatError(f"an export ends with its {MANIFEST}; the files ended with {last or 'nothing'}")
        fsync_dir(tmp / TABLES_DIR)
        fsync_dir(tmp)
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        fsync_dir(out.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return total


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of export directory ``path``; raises ExportFormatError."""
    file = Path(path) / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise ExportFormatError(
            f"{path} is not an rpcps export (no {MANIFEST}; an export whose writing was interrupted has none): "
            "run `rpcps export --checkpoint DIR --out PATH` again"
        ) from None
    except (OSError, ValueError) as e:
        raise ExportFormatError(f"{file} cannot be read: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ExportFormatError(f"{file} is not an {FORMAT} manifest")
    return manifest


def load_dense(path: str | Path, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    return load_state_dict(Path(path) / manifest["dense"])


def load_table(path: str | Path, manifest: dict[str, Any], name: str, verify: bool = True) -> dict[str, torch.Tensor]:
    """One table's ``{"ids", "weight"(, "state")}``, its parts concatenated; raises ExportFormatError
    when a part is missing, fails its checksum (``verify``) or has the wrong shape."""
    import torch

    entry = manifest["tables"][name]
    pieces: list[dict[str, torch.Tensor]] = []
    for part in entry["parts"]:
        file = Path(path) / part["file"]
        try:
            if verify:
                with open(file, "rb") as f:
                    digest = hashlib.file_digest(f, "sha256").hexdigest()
                if digest != part["sha256"]:
                    raise ExportFormatError(f"{file} fails its SHA-256 checksum (corrupted or replaced); export again")
            tensors = load_state_dict(file)
        except OSError as e:
            raise ExportFormatError(f"{file} cannot be read ({e.strerror or e}); export again") from None
        if tensors["ids"].shape != (part["rows"],) or tensors["weight"].shape != (part["rows"], entry["dim"]):
            raise ExportFormatError(f"{file} holds {tuple(tensors['weight'].shape)} rows, its manifest says ({part['rows']}, {entry['dim']})")
        pieces.append(tensors)
    keys = pieces[0].keys() if pieces else ("ids", "weight")
    return {key: torch.cat([p[key] for p in pieces]) for key in keys}
