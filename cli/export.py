"""``rpcps export``: a checkpoint to the model's own ``state_dict`` file (the work is ``ps.checkpoints.export``'s).

    rpcps export --checkpoint DIR --out model.pt [--format auto|torch|safetensors]
    rpcps export --checkpoint DIR --out EXPORT_DIR [--optimizer-state on]     (a model with sparse tables)

Prints one line saying what was written. A directory with nothing valid to export, or a sharded one
missing a shard, is one line on stderr and exit 2; a failed write exit 1 (``cli.main``).
"""

from __future__ import annotations

from cli.config import ExportConfig
from ps.checkpoints.export import export_checkpoint


def run_export(config: ExportConfig) -> int:
    assert config.checkpoint is not None and config.out is not None  # ExportConfig requires them
    result = export_checkpoint(config.checkpoint, config.out, config.file_format, config.optimizer_state, config.part_rows)
    versions = "/".join(map(str, result.versions))
    tables = "" if result.tables is None else f" and {len(result.tables)} sparse tables ({sum(result.tables.values())} rows)"
    print(
        f"rpcps export: wrote {result.tensors} tensors{tables} ({result.size_bytes} bytes) of model version {versions} "
        f"from {', '.join(map(str, result.snapshots))} to {result.path}",
        flush=True,
    )
    return 0
