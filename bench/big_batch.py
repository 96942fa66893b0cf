"""Data plug-ins for the benchmarks: mlp_5m's regression data in other batch sizes.

Kept in bench/ (not rpcps.tasks), used as ``--data bench.big_batch:<name>`` with the repository
root on PYTHONPATH: batches of 2048 make a compute-heavy step (bench/comm_fraction.py); batches of 64
are the end-to-end comparison's (bench/vs_example.py, the batch issue 12 measured with).
"""

from __future__ import annotations

from rpcps.tasks import RegressionData


def mlp_5m_data_2048(worker_index: int, num_workers: int) -> RegressionData:
    del num_workers
    return RegressionData(worker_index, 1024, batch_size=2048)


def mlp_5m_data_64(worker_index: int, num_workers: int) -> RegressionData:
    del num_workers
    return RegressionData(worker_index, 1024, batch_size=64)
