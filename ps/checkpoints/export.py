"""The trained model as the user's own ``state_dict``: from a checkpoint directory, or from a live server.

What the server holds is flat fp32 master chunks (one set per shard) and the model's buffers; this
module turns them back into ``{name: tensor}`` with every parameter in the model's own dtype and
shape, plus every persistent buffer, which is what ``model.load_state_dict`` takes. A sharded
checkpoint is exported whole: each shard's newest valid snapshot gives its parameters, shard 0 the
buffers. Parameters the model does not train (``requires_grad=False``) never reach the server and are
not in the file: such a model loads it with ``strict=False`` and keeps those from its factory.

A model with sparse tables is exported as a directory instead (rpcps/sparse/export_files.py): the
same state_dict plus every table's ids and rows, which ``ps.checkpoints.sparse_export`` streams out of each
server's chain of snapshots, and ``rpcps.sparse.serving.load_export`` reads back.

Used by ``rpcps export`` (``cli.export``), the control plane's ``ExportModel`` (through
``ParameterServer.model_state``) and from Python::

    from ps.checkpoints.export import export_checkpoint
    export_checkpoint("/ckpt", "model.pt")
    model.load_state_dict(torch.load("model.pt", weights_only=True))

Reading never changes the checkpoint directory (an invalid snapshot is skipped, not moved aside).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ps.checkpoints.snapshot_files import MANIFEST_FILE, InvalidSnapshot, list_snapshots, load_snapshot
from ps.checkpoints.sparse_checkpoint import chain_names
from ps.checkpoints.sparse_export import checkpoint_tables, export_files
from ps.sparse.checkpoint import InvalidPayload
from rpcps.model_file import save_state_dict
from rpcps.signature import DEFAULT_CHUNK_BYTES, FlatLayout, ModelSignature, named_state
from rpcps.sparse.export_files import DEFAULT_PART_ROWS, MANIFEST, PartFile, check_out, directory_format, write_export

logger = logging.getLogger(__name__)

_SHARD_DIR = re.compile(r"^shard-(\d+)-of-(\d+)$")


class ExportError(ValueError):
    """The directory holds no exportable model (the message says why and what to point at)."""


@dataclass(frozen=True)
class Exported:
    state_dict: dict[str, torch.Tensor]
    versions: tuple[int, ...]
    """The model version of each shard's snapshot (one entry when unsharded)."""
    snapshots: tuple[Path, ...]
    manifests: tuple[dict[str, Any], ...] = ()
    """Each snapshot's verified manifest, in shard order."""
    sparse: bool = False
    """The snapshots hold sparse tables (their rows are exported by ``ps.checkpoints.sparse_export``)."""


@dataclass(frozen=True)
class ExportResult:
    path: Path
    size_bytes: int
    versions: tuple[int, ...]
    snapshots: tuple[Path, ...]
    tensors: int
    tables: dict[str, int] | None = None
    """Rows exported per sparse table; None for a model without them (``path`` is then one file)."""


def read_checkpoint(path: str | Path) -> Exported:
    """The whole model from a checkpoint: a snapshot directory (``step-N``), a ``--checkpoint-dir``
    (its newest valid snapshot) or the root of a sharded one (each shard's newest valid snapshot).

    Raises:
        ExportError: nothing valid to export, shards missing, or shards of different models.
    """
    root = Path(path)
    parts = [_newest_valid(candidates) for candidates in _candidates(root)]
    manifests = [m for m, _, _ in parts]
    if len(parts) == 1 and int(manifests[0].get("shard_count", 1)) > 1:
        raise ExportError(
            f"{parts[0][2]} is shard {manifests[0].get('shard_index')} of {manifests[0].get('shard_count')}: it holds only "
            "that shard's parameters; export the checkpoint root (the directory holding the shard-K-of-S directories)"
        )
    digests = {m.get("signature_digest") for m in manifests}
    if len(digests) > 1:
        raise ExportError(f"the shards under {root} hold different models (signature digests {sorted(map(str, digests))})")
    state: dict[str, torch.Tensor] = {}
    for manifest, snapshot, where in parts:
        signature = ModelSignature.from_wire(manifest.get("signature", []))
        chunk_bytes = int(manifest.get("config", {}).get("core", {}).get("chunk_bytes", DEFAULT_CHUNK_BYTES))
        layout = FlatLayout(signature, chunk_bytes)
        if [m.numel() for m in snapshot["masters"]] != list(layout.chunk_numels):
            raise ExportError(f"{where}: its parameter chunks do not match its manifest's signature")
        state.update(named_state(layout, snapshot["masters"], snapshot.get("buffers", {})))
    model = ModelSignature.from_wire(manifests[0].get("model_signature") or manifests[0].get("signature", []))
    order = [p.name for p in model.params] + [b.name for b in model.buffers]
    missing = [name for name in order if name not in state]
    if missing:
        raise ExportError(f"{root}: the snapshots lack {missing[:5]}; are all shards there?")
    return Exported(
        {name: state[name] for name in order},
        tuple(int(m["version"]) for m in manifests),
        tuple(where for _, _, where in parts),
        tuple(manifests),
        any(chain_names(m) or snapshot.get("sparse") for m, snapshot, _ in parts),
    )


def export_checkpoint(
    checkpoint: str | Path, out: str | Path, fmt: str = "auto", with_state: bool = False, part_rows: int = DEFAULT_PART_ROWS
) -> ExportResult:
    """Writes the model held by ``checkpoint`` (see ``read_checkpoint``) to ``out``: a state_dict
    file, or for a model with sparse tables a directory with the state_dict and every table's rows
    (rpcps/sparse/export_files.py; ``with_state`` adds their optimizer state, ``part_rows`` bounds a
    part file).

    ``fmt``: ``torch``, ``safetensors`` or ``auto`` (by ``out``'s suffix; torch for a directory).
    Raises ExportError, ValueError (format; a file path for a sparse model) and OSError (writing).
    """
    exported = read_checkpoint(checkpoint)
    sources = ", ".join(map(str, exported.snapshots))
    versions = "/".join(map(str, exported.versions))
    if not exported.sparse:
        size = save_state_dict(exported.state_dict, out, fmt)
        logger.info("exported %d tensors from %s (version %s) to %s", len(exported.state_dict), sources, versions, out)
        return ExportResult(Path(out), size, exported.versions, exported.snapshots, len(exported.state_dict))
    check_out(out)
    try:
        tables = checkpoint_tables(list(zip(exported.snapshots, exported.manifests)))
    except (InvalidSnapshot, InvalidPayload) as e:
        raise ExportError(f"{checkpoint}: its sparse tables cannot be read: {e}") from None
    info = {"model_versions": list(exported.versions), "source": [str(p) for p in exported.snapshots]}
    resolved = directory_format(fmt)
    files = export_files(exported.state_dict, tables, resolved, info, part_rows, with_state)
    rows: dict[str, int] = {}
    size = write_export(_counting_rows(files, rows), out)
    logger.info("exported %d tensors and %d sparse tables (%d rows) from %s (version %s) to %s",
                len(exported.state_dict), len(rows), sum(rows.values()), sources, versions, out)
    return ExportResult(Path(out), size, exported.versions, exported.snapshots, len(exported.state_dict), rows)


def _counting_rows(files: Iterator[tuple[str, bytes | PartFile]], rows: dict[str, int]) -> Iterator[tuple[str, bytes | PartFile]]:
    """Passes the files on; reads the row count of each table from the manifest (the last file)."""
    for name, data in files:
        if name == MANIFEST and isinstance(data, bytes):
            rows.update({table: entry["rows"] for table, entry in json.loads(data)["tables"].items()})
        yield name, data


def _candidates(root: Path) -> list[list[Path]]:
    """Per shard, its snapshot directories newest first."""
    if (root / MANIFEST_FILE).exists():
        return [[root]]
    snapshots = list_snapshots(root)
    if snapshots:
        return [snapshots]
    shards: dict[int, dict[int, Path]] = {}
    for child in root.iterdir() if root.is_dir() else []:
        match = _SHARD_DIR.match(child.name)
        if match and child.is_dir() and list_snapshots(child):
            shards.setdefault(int(match.group(2)), {})[int(match.group(1))] = child
    if not shards:
        raise ExportError(f"{root} holds no snapshot (expected step-* directories, or shard-K-of-S directories holding them)")
    if len(shards) > 1:
        raise ExportError(f"{root} holds snapshots of several shard counts ({sorted(shards)}); export one run's directory")
    (count, found), = shards.items()
    absent = sorted(set(range(count)) - set(found))
    if absent:
        raise ExportError(f"{root} is a checkpoint of {count} shards but holds none of shard(s) {absent}")
    return [list_snapshots(found[k]) for k in range(count)]


def _newest_valid(candidates: list[Path]) -> tuple[dict[str, Any], dict[str, Any], Path]:
    for path in candidates:
        try:
            manifest, state = load_snapshot(path)
        except InvalidSnapshot as e:
            logger.warning("skipping snapshot %s: %s", path, e)
            continue
        return manifest, state, path
    raise ExportError(f"no valid snapshot among {[str(p) for p in candidates]} (each was incomplete or corrupt; see the log)")
