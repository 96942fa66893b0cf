"""Inference without a server: a model with sparse tables answered from an export directory.

``load_export(model, path)`` loads the export's dense ``state_dict`` into ``model`` and attaches to
each of its sparse modules (``SparseEmbeddingBagCollection``) a row source that reads the exported
rows, so ``model(batch)`` works in a plain process, on the CPU or a GPU::

    from rpcps.sparse.serving import load_export
    from rpcps.examples import ctr
    model = load_export(ctr.dlrm_model(), "/tmp/ctr-export")     # device="auto": a GPU when there is one
    scores = model(batch.to(model_device(model)))

Ids the export does not hold read what the server would have answered for them: their
deterministic initial row (``rpcps.sparse.row_init``, from the run's seed and scale) when the run
admitted every id on first sight, zeros when it ran with admission (``--sparse-admit-count``: a new
id reads zeros until admitted). The export's manifest says which (``unseen``). Lookups change
nothing: an unseen id gets no row, and asking again gives the same answer.

A table's rows are held on the device sorted by id (a lookup is a ``searchsorted``): about the
exported bytes, plus their size again while loading. This module is in the shared layer and imports
neither ``ps`` nor ``worker``: it finds sparse modules by what they declare (``sparse_tables``,
``attach``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from rpcps.sparse.export_files import ExportFormatError, load_dense, load_table, read_manifest
from rpcps.sparse.row_init import RowInitConfig, initial_rows
from rpcps.sparse.spec import SparsePull, TableSpec, declared_tables

logger = logging.getLogger(__name__)

UNSEEN = ("init", "zeros")


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto``: the current GPU when there is one, else the CPU; anything else as torch reads it."""
    if str(device) == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {device!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for a GPU but none is available here; use auto or cpu")
    return resolved


class ExportedTable:
    """One table's exported rows, sorted by id, on one device; ``lookup`` answers any ids."""

    def __init__(self, spec: TableSpec, ids: torch.Tensor, weight: torch.Tensor, unseen: str, init: RowInitConfig | None,
                 device: torch.device) -> None:
        if unseen not in UNSEEN:
            raise ExportFormatError(f"table {spec.name!r}: unseen must be one of {list(UNSEEN)}, got {unseen!r}")
        if unseen == "init" and init is None:
            raise ExportFormatError(f"table {spec.name!r}: unseen ids read their initial row, but the export has no init settings")
        order = ids.argsort()
        self.spec = spec
        self.ids = ids[order].to(device)
        self.weight = weight[order].to(device)
        self.unseen = unseen
        self.init = init

    def __len__(self) -> int:
        return self.ids.numel()

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows ``[len(ids), dim]`` on the table's device, for int64 ids on any device."""
        ids = ids.to(self.ids.device)
        out = torch.zeros(ids.numel(), self.spec.dim, dtype=torch.float32, device=self.ids.device)
        hit = torch.zeros(ids.numel(), dtype=torch.bool, device=self.ids.device)
        if len(self):
            at = torch.searchsorted(self.ids, ids).clamp_(max=len(self) - 1)
            hit = self.ids[at] == ids
            out[hit] = self.weight[at[hit]]
        if self.unseen == "init":
            missing = (~hit).nonzero().squeeze(1)
            if missing.numel():
                assert self.init is not None
                # Computed on the CPU: the same integer hashing the server ran, so the same bits.
                rows = initial_rows(self.init, self.spec.table_id, ids[missing].cpu(), self.spec.dim)
                out[missing] = rows.to(out.device)
        return out


class ExportedRows:
    """A row source (``rpcps.sparse.embedding.RowSource``) over exported tables: read-only lookups."""

    def __init__(self, tables: dict[str, ExportedTable]) -> None:
        self.tables = tables

    def pull(self, request: SparsePull) -> SparsePull:
        unknown = set(request) - set(self.tables)
        if unknown:
            raise KeyError(f"the export holds no sparse table {sorted(unknown)}; it has {sorted(self.tables)}")
        return {name: self.tables[name].lookup(ids) for name, ids in request.items()}


def load_rows(path: str | Path, specs: tuple[TableSpec, ...], device: str | torch.device = "cpu",
              verify: bool = True) -> ExportedRows:
    """The exported rows of the tables ``specs`` declare; raises ExportFormatError on a mismatch."""
    where = resolve_device(device)
    manifest = read_manifest(path)
    saved: dict[str, Any] = manifest.get("tables", {})
    declared = {s.name for s in specs}
    if set(saved) != declared:
        raise ExportFormatError(
            f"{path} holds sparse tables {sorted(saved)}, the model declares {sorted(declared)}: is it this model's export?"
        )
    tables = {}
    for spec in specs:
        entry = saved[spec.name]
        if (int(entry["table_id"]), int(entry["dim"])) != (spec.table_id, spec.dim):
            raise ExportFormatError(
                f"{path}: table {spec.name!r} has id {entry['table_id']} and dim {entry['dim']}, "
                f"the model declares id {spec.table_id} and dim {spec.dim}"
            )
        loaded = load_table(path, manifest, spec.name, verify)
        init = RowInitConfig(**entry["init"]) if entry.get("init") else None
        tables[spec.name] = ExportedTable(spec, loaded["ids"], loaded["weight"], entry["unseen"], init, where)
        logger.info("sparse table %s: %d exported rows on %s (unseen ids read %s)", spec.name, len(tables[spec.name]), where,
                    entry["unseen"])
    return ExportedRows(tables)


def load_export(model: torch.nn.Module, path: str | Path, device: str | torch.device = "auto",
                verify: bool = True) -> torch.nn.Module:
    """``model`` with the export's dense state_dict loaded and its sparse modules reading the export's
    rows, moved to ``device`` and in eval mode; returns it.

    Raises:
        ExportFormatError: ``path`` is not an export, or not of this model (tables, widths, checksums).
        RuntimeError: the dense state_dict does not fit the model (``load_state_dict``'s message).
        ValueError: ``device`` is not usable here.
    """
    where = resolve_device(device)
    manifest = read_manifest(path)
    model.load_state_dict(load_dense(path, manifest))
    rows = load_rows(path, declared_tables(model), where, verify)
    for module in model.modules():
        attach = getattr(module, "attach", None)
        if getattr(module, "sparse_tables", ()) and callable(attach):
            attach(rows)
    return model.to(where).eval()
