"""Server-side sparse embedding tables: in-process data structures and numerics, no RPC, no I/O.

Modules, one job each:
- hashing, sharding: in rpcps.sparse (workers route ids with them too); re-exported here.
- index: id -> row open-addressing index (vectorised probing, tombstones, rehash).
- slab: fp32 rows with optimizer state inline, per-row metadata, free list, dirty log.
- row_init: in rpcps.sparse (an export's reader answers unseen ids with it too); re-exported here.
- row_optim: SGD, Adagrad, row-wise Adagrad, lazy Adam, FTRL on gathered row blocks.
- row_image: the row-numbered buffer that makes a sliced full capture exact.
- admission: count-min or deterministic-coin admission of new ids.
- eviction: which rows a sweep evicts (TTL, LFU with decay, row cap).
- checkpoint: full / delta payloads, chain checks, compaction.
- pull_memo: the rows of a table's recent pulls, so the push of the same ids skips the index.
- table: SparseTable, the per-table facade with its lock and counters.
"""

from ps.sparse.admission import CountAdmissionConfig, ProbabilityAdmissionConfig
from ps.sparse.checkpoint import InvalidPayload, compact
from ps.sparse.eviction import EvictionConfig
from ps.sparse.index import IndexConfig
from ps.sparse.row_optim import FTRL, SGD, Adagrad, LazyAdam, RowWiseAdagrad
from ps.sparse.table import ApplyResult, EvictionSlice, FullCapture, SparseTable, TableConfig, TableStats
from rpcps.sparse.row_init import RowInitConfig
from rpcps.sparse.sharding import BucketManifest, BucketRange, bucket_of

__all__ = [
    "FTRL",
    "SGD",
    "Adagrad",
    "ApplyResult",
    "BucketManifest",
    "BucketRange",
    "CountAdmissionConfig",
    "EvictionConfig",
    "EvictionSlice",
    "FullCapture",
    "IndexConfig",
    "InvalidPayload",
    "LazyAdam",
    "ProbabilityAdmissionConfig",
    "RowInitConfig",
    "RowWiseAdagrad",
    "SparseTable",
    "TableConfig",
    "TableStats",
    "bucket_of",
    "compact",
]
