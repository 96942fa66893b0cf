"""Settings of the command-line-only roles ``local``, ``export`` and ``reshard`` (``ctl``'s are in ``cli.ctl_config``)."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field

from evaluator.config import EvaluatorConfig
from ps.config import ServerRunConfig
from rpcps.address import Address, EtcdAddress
from rpcps.model_file import FORMATS
from rpcps.process import ProcessOptions, listen_setting, trust_network_setting
from rpcps.settings import setting
from rpcps.transport.config import TransportOptions
from worker.config import WorkerConfig


@dataclass(kw_only=True, frozen=True)
class LocalConfig:
    """Local run (a server and its workers on this machine)."""

    workers: int = setting(2, help="worker processes to start")
    run_dir: str | None = setting(None, help="directory for the children's logs and summaries", metavar="DIR")
    max_restarts: int = setting(3, help="restarts of a crashed child before giving up")
    port: int = setting(0, help="the server's port; 0 picks a free one")
    store: Address | EtcdAddress | None = setting(
        None,
        help="etcd://HOST:PORT[,HOST:PORT...]/PREFIX: keep the job's coordination state in this etcd cluster; local then "
        "starts no coordinator (not even with --replicas 2) and its servers, workers and evaluator join through etcd "
        "(docs/FAULT_TOLERANCE.md); ?cacert=FILE[&cert=FILE&key=FILE] for TLS (docs/SECURITY.md); unset: local keeps "
        "the store in a coordinator or in shard 0's server",
        metavar="etcd://HOST:PORT[,...]/PREFIX",
    )
    worker_script: str | None = setting(
        None,
        help="run this Python script (and the arguments after it, in one quoted string) as each worker instead of "
        "the built-in loop: a training loop of your own on worker.api (docs/API.md); it gets the worker flags, and "
        "the servers use --model",
        metavar="'PATH [ARGS]'",
    )
    process: ProcessOptions = field(default_factory=ProcessOptions)
    server: ServerRunConfig = field(default_factory=ServerRunConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)
    """Used when --eval-data is given: an evaluator runs beside the workers."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.store is not None and not isinstance(self.store, EtcdAddress):
            raise ValueError(
                f"store must be etcd://HOST:PORT[,HOST:PORT...]/PREFIX, got {self.store}: local starts its own store "
                "otherwise (drop --store, or run rpcps ps and rpcps worker against an existing coordinator)"
            )
        if self.worker_script is not None:
            words = shlex.split(self.worker_script)
            if not words or not os.path.isfile(words[0]):
                raise ValueError(f"worker_script {self.worker_script!r} does not start with a file's path")


@dataclass(kw_only=True, frozen=True)
class ExportConfig:
    """Export (a checkpoint to the model's own state_dict file)."""

    checkpoint: str | None = setting(
        None, help="what to export: a --checkpoint-dir (its newest valid snapshot), the root of a sharded one, "
        "or one step-N snapshot directory", metavar="DIR",
    )
    out: str | None = setting(
        None, help="the file to write; for a model with sparse tables, the directory (the state_dict and every "
        "table's ids and rows, docs/SPARSE.md)", metavar="PATH",
    )
    file_format: str = setting(
        "auto", flag="--format", help="torch (torch.load(weights_only=True)), safetensors, or auto (by --out's suffix; "
        "torch for a directory)",
        choices=lambda: FORMATS,
    )
    optimizer_state: bool = setting(False, help="sparse tables: also export each row's optimizer state")
    part_rows: int = setting(1 << 20, help="sparse tables: rows per part file (bounds the memory of writing and reading)")
    process: ProcessOptions = field(default_factory=ProcessOptions)

    def __post_init__(self) -> None:
        if not self.checkpoint:
            raise ValueError("checkpoint is required: --checkpoint DIR")
        if not self.out:
            raise ValueError("out is required: --out PATH")
        if self.file_format not in FORMATS:
            raise ValueError(f"format must be one of {list(FORMATS)}, got {self.file_format!r}")
        if self.part_rows < 1:
            raise ValueError(f"part_rows must be >= 1, got {self.part_rows}")


@dataclass(kw_only=True, frozen=True)
class ReshardConfig:
    """Reshard (a stopped job's checkpoint directory rewritten for another number of server shards)."""

    checkpoint_dir: str | None = setting(
        None, flag="--checkpoint-dir", help="the job's --checkpoint-dir (every server of the job stopped)", metavar="DIR"
    )
    shards: int | None = setting(None, help="the number of server shards the job resumes with", metavar="N")
    job_secret_file: str | None = setting(
        None, help="with --sign-checkpoints: the job's secret file, to verify the old snapshots and sign the new ones",
        metavar="PATH",
    )
    sign: bool = setting(False, flag="--sign-checkpoints", help="the job signs its snapshots (its servers run with --sign-checkpoints)")
    process: ProcessOptions = field(default_factory=ProcessOptions)

    def __post_init__(self) -> None:
        if not self.checkpoint_dir:
            raise ValueError("checkpoint_dir is required: --checkpoint-dir DIR")
        if self.shards is None or self.shards < 1:
            raise ValueError(f"shards is required and must be >= 1: --shards N (got {self.shards})")
        if self.sign and self.job_secret_file is None:
            raise ValueError("--sign-checkpoints needs --job-secret-file (the secret the job signs its snapshots with)")


DEFAULT_STORE_METRICS_PORT = 9390


@dataclass(kw_only=True, frozen=True)
class StoreConfig:
    """Coordinator (the group's store and janitor; no training state)."""

    listen: Address = listen_setting("of the group's rendezvous store; servers use it as --store, workers as --ps")
    lease_s: float = setting(10.0, help="a member silent this long (hung or cut off) is removed from the group")
    trust_network: bool = trust_network_setting("this process's")
    metrics_port: int = setting(DEFAULT_STORE_METRICS_PORT, help="coordinator /metrics port; 0 picks a free one (logged)")
    process: ProcessOptions = field(default_factory=ProcessOptions)
    transport: TransportOptions = field(default_factory=TransportOptions)

    def __post_init__(self) -> None:
        if not self.lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
