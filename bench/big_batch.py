"""A compute-heavy data plug-in for the benchmarks: mlp_5m's regression data in large batches.

Kept in bench/ (not rpcps.tasks): only bench/comm_fraction.py uses it, as
``--data bench.big_batch:mlp_5m_data_2048`` with the repository root on PYTHONPATH.
"""

from __future__ import annotations

from rpcps.tasks import RegressionData


def mlp_5m_data_2048(worker_index: int, num_workers: int) -> RegressionData:
    del num_workers
    return RegressionData(worker_index, 1024, batch_size=2048)
