"""``rpcps reshard``: a stopped job's checkpoint directory rewritten for another --shards (the work is
``ps.checkpoints.reshard_files``'s).

    rpcps reshard --checkpoint-dir DIR --shards N [--sign-checkpoints --job-secret-file PATH]

Prints one line saying what was converted and where the old layout went. A refusal (states that
cannot be redistributed, an ambiguous directory, an unfinished conversion to another count) is one
line on stderr and exit 2; a failed write exit 1, and running the same command again finishes it
(``cli.main``).
"""

from __future__ import annotations

from pathlib import Path

from cli.config import ReshardConfig
from ps.checkpoints.reshard_files import reshard_directory
from rpcps.jobsecret import JobSecret


def run_reshard(config: ReshardConfig) -> int:
    assert config.checkpoint_dir is not None and config.shards is not None  # ReshardConfig requires them
    signer = JobSecret.from_file(config.job_secret_file).manifest_signature if config.sign and config.job_secret_file else None
    done = reshard_directory(Path(config.checkpoint_dir), config.shards, verify=signer, sign=signer)
    print(
        f"rpcps reshard: {config.checkpoint_dir} now holds {done.new_count} shard(s) at version {done.version} "
        f"(from {done.old_count}: {', '.join(map(str, done.sources)) or 'written by an earlier, interrupted run'}); "
        f"the old layout is in {done.aside}; resume the job with --shards {done.new_count}",
        flush=True,
    )
    return 0
