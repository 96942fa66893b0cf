"""Checkpoints of a shard on disk: writing, finding, verifying, resharding and exporting them.

``checkpointer.py`` writes and purges snapshots on its thread and finds the resume point;
``snapshot_files.py`` is the on-disk format (temporary name, fsync, rename, manifest last);
``sparse_checkpoint.py`` writes the sparse tables' full/delta chains; ``reshard.py`` and
``reshard_files.py`` move a checkpoint to another shard count; ``export.py`` and ``sparse_export.py``
turn one into the model's own files; ``audit.py`` is the append-only record of what was applied and
saved. It reads ``ps.core`` (the server's state) and is never imported by it.
"""
