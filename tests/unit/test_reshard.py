"""Resharding a stopped job's state (ps/checkpoints/reshard.py) and its checkpoint directory (ps/checkpoints/reshard_files.py),
in-process on real files (no processes): parameters and Adam state move bit for bit, training
then continues exactly as on the old shards, a retried step is still a duplicate, sparse rows
follow their buckets, and every case that would mix or lose state is refused naming what to do."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.inprocess import SMALL_CHUNK_BYTES, InProcessServer, grads_like, make_model
from ps.checkpoints import reshard_files
from ps.checkpoints.checkpointer import Checkpointer, ResumeRefused, find_resume_point, shard_checkpoint_config
from ps.checkpoints.reshard import OldShard, ReshardRefused, reshard
from ps.checkpoints.reshard_files import JOURNAL, reshard_directory
from ps.checkpoints.snapshot_files import FINISHED_FILE, list_snapshots
from ps.config import CheckpointConfig
from ps.core.config import ServerCoreConfig
from ps.core.optim import OptimizerConfig
from rpcps.jobsecret import JobSecret
from rpcps.messages import PushStatus
from tests.unit.test_sparse_server import TinyModel, _rows, _train_sharded

ADAM = OptimizerConfig(name="adam", kwargs={"lr": 0.01})
SGD = OptimizerConfig(name="sgd", kwargs={"lr": 0.1, "momentum": 0.9})


def _shards(count: int, optimizer: OptimizerConfig = ADAM) -> list[InProcessServer]:
    servers = []
    for k in range(count):
        config = ServerCoreConfig(optimizer=optimizer, chunk_bytes=SMALL_CHUNK_BYTES, shard_index=k, shard_count=count)
        servers.append(InProcessServer(make_model(), config))
    return servers


def _push(servers: list[InProcessServer], slot: int, seq: int, only: list[int] | None = None) -> list[str]:
    """Step ``seq`` of ``slot``: each shard gets its parameters' part of one gradient (a worker's push)."""
    names = [name for name, _ in make_model().named_parameters()]
    grads = dict(zip(names, grads_like(make_model(), 1000 * slot + seq)))
    statuses = []
    for k, server in enumerate(servers):
        if only is not None and k not in only:
            continue
        record = server.workers.records.get(slot)
        if record is None or record.left:  # a restored server knows the slot's steps, not its worker
            server.register(slot, f"w{slot}", server.model_signature.to_wire())
            record = server.workers.records[slot]
        incarnation = record.incarnation
        mine = {slot_.spec.name: grads[slot_.spec.name] for slot_ in server.layout.slots}
        statuses.append(server.push_named(slot, incarnation, seq, server.version, mine).status)
    return statuses


def _train(servers: list[InProcessServer], seqs: range) -> None:
    for seq in seqs:
        for slot in (0, 1):
            assert set(_push(servers, slot, seq)) == {PushStatus.APPLIED}


def _params(servers: list[InProcessServer]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for server in servers:
        out.update(server.master_tensors())
    return out


def _old(servers: list[InProcessServer]) -> list[OldShard]:
    return [OldShard(k, s.capture_state()[1], f"shard {k}") for k, s in enumerate(servers)]


def _restored(states: list[dict[str, Any]], optimizer: OptimizerConfig = ADAM) -> list[InProcessServer]:
    servers = _shards(len(states), optimizer)
    for server, state in zip(servers, states):
        server.restore_state(state)
    return servers


@pytest.mark.parametrize("new_count", [1, 3])
@pytest.mark.parametrize("optimizer", [ADAM, SGD, OptimizerConfig(name="sgd"), OptimizerConfig(name="adagrad"),
                                       OptimizerConfig(name="rmsprop", kwargs={"momentum": 0.5, "centered": True})],
                         ids=["adam", "sgd-momentum", "sgd", "adagrad", "rmsprop"])
def test_parameters_and_optimizer_state_move_bit_for_bit_and_training_continues_as_before(
    new_count: int, optimizer: OptimizerConfig
) -> None:
    old = _shards(2, optimizer)
    _train(old, range(4))
    states = reshard(old[0].model_signature, _old(old), new_count, SMALL_CHUNK_BYTES)
    new = _restored(states, optimizer)
    assert all(torch.equal(a, _params(new)[name]) for name, a in _params(old).items())
    before, after = _optimizer_state(old), _optimizer_state(new)
    assert before.keys() == after.keys() and all(torch.equal(v, after[k]) for k, v in before.items())
    assert [s.version for s in new] == [8] * new_count
    # A retried push of a step the old shards processed is still a duplicate on every new shard.
    assert set(_push(new, 0, 3)) == {PushStatus.DUPLICATE}
    _train(old, range(4, 7))
    _train(new, range(4, 7))
    if optimizer is SGD:
        # torch's fused SGD with momentum rounds an element differently by its place in the tensor
        # (vectorised body or tail; tried on plain tensors), and a reshard moves parameters within their chunks.
        for name, a in _params(old).items():
            torch.testing.assert_close(_params(new)[name], a, rtol=0, atol=1e-6)
    else:  # the same steps from the moved state give the same bits
        assert all(torch.equal(a, _params(new)[name]) for name, a in _params(old).items())


def _optimizer_state(servers: list[InProcessServer]) -> dict[tuple[str, str], torch.Tensor]:
    """(parameter, key) -> that parameter's slice of its chunk's optimizer state (a per-chunk value as is)."""
    out = {}
    for server in servers:
        state = server.optimizer.state_dict()["state"]
        for slot in server.layout.slots:
            for key, value in state.get(slot.chunk, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() == 1:
                    value = value[slot.offset : slot.offset + slot.spec.numel]
                out[(slot.spec.name, key)] = value
    return out


def test_a_step_one_old_shard_applied_and_another_did_not_is_refused_naming_the_slot() -> None:
    old = _shards(2)
    _train(old, range(2))
    _push(old, 1, 2, only=[0])  # the worker died between its pushes to the two shards
    with pytest.raises(ReshardRefused, match=r"worker slot 1 is not at the same step on every shard \(shard 0 through step 2, "
                                             r"shard 1 through step 1\).*Resume with the old --shards"):
        reshard(old[0].model_signature, _old(old), 1, SMALL_CHUNK_BYTES)


def test_adam_at_different_step_counts_is_refused_and_sgd_takes_the_largest_version() -> None:
    nan = {"0.weight": torch.full((20, 12), float("nan"))}
    for optimizer in (ADAM, SGD):
        old = _shards(2, optimizer)
        _train(old, range(2))
        holder = next(k for k, s in enumerate(old) if s.layout.slot("0.weight") is not None)
        # Step 2 of slot 0 is refused (NaN) by the shard holding 0.weight and applied by the other:
        # both record it as processed, their versions differ.
        for k, server in enumerate(old):
            grads = nan if k == holder else None
            if grads is None:
                _push(old, 0, 2, only=[k])
            else:
                incarnation = server.workers.records[0].incarnation
                mine = {s.spec.name: grads.get(s.spec.name, torch.zeros(s.spec.shape)) for s in server.layout.slots}
                with pytest.raises(Exception, match="NaN|nonfinite|finite"):
                    server.push_named(0, incarnation, 2, server.version, mine)
        assert sorted(s.version for s in old) == [4, 5]
        if optimizer is ADAM:
            with pytest.raises(ReshardRefused, match="optimizer state differs.*different step counts"):
                reshard(old[0].model_signature, _old(old), 1, SMALL_CHUNK_BYTES)
        else:
            new = _restored(reshard(old[0].model_signature, _old(old), 1, SMALL_CHUNK_BYTES), SGD)
            assert new[0].version == 5 and all(torch.equal(a, _params(new)[n]) for n, a in _params(old).items())


def _meta(server: InProcessServer) -> dict[str, Any]:
    """What ps.runner._meta writes into every manifest."""
    core = server.config
    return {
        "signature": server.signature.to_wire(), "model_signature": server.model_signature.to_wire(),
        "signature_digest": server.model_signature.digest(), "optimizer": core.optimizer.name,
        "shard_index": core.shard_index, "shard_count": core.shard_count, "partition_digest": server.partition_digest,
        "config": {"core": {"chunk_bytes": core.chunk_bytes}},
    }


def _checkpoint(servers: list[InProcessServer], root: Path, sign: Any = None) -> None:
    for k, server in enumerate(servers):
        config = shard_checkpoint_config(CheckpointConfig(directory=str(root), every_seconds=None), k, len(servers))
        Path(config.directory).mkdir(parents=True, exist_ok=True)  # type: ignore[arg-type]
        Checkpointer(server.core, config, _meta(server), server.core.metrics, sign=sign).checkpoint_now()  # type: ignore[arg-type]


def _resume(root: Path, fresh: list[InProcessServer]) -> list[InProcessServer]:
    for k, server in enumerate(fresh):
        config = shard_checkpoint_config(CheckpointConfig(directory=str(root)), k, len(fresh))
        point = find_resume_point(config, server.signature, server.config.optimizer.name, server.partition_digest)
        assert point is not None
        server.restore_state(point[1])
    return fresh


def test_a_directory_of_two_shards_is_refused_for_one_until_resharded_then_resumes_exactly(tmp_path: Path) -> None:
    old = _shards(2)
    _train(old, range(3))
    _checkpoint(old, tmp_path)
    (tmp_path / "shard-0-of-2" / FINISHED_FILE).write_text(json.dumps({"0": 3, "1": 3}))
    (tmp_path / "shard-1-of-2" / FINISHED_FILE).write_text(json.dumps({"0": 3}))
    for never in ("auto", "never"):
        with pytest.raises(ResumeRefused, match=r"holds snapshots of 2 shard\(s\), but this server is unsharded \(--shards 1\).*"
                                                r"rpcps reshard --checkpoint-dir .* --shards 1"):
            shard_checkpoint_config(CheckpointConfig(directory=str(tmp_path), resume=never), 0, 1)
    done = reshard_directory(tmp_path, 1)
    assert (done.old_count, done.new_count, done.version) == (2, 1, 6)
    assert sorted(p.name for p in done.aside.iterdir()) == ["shard-0-of-2", "shard-1-of-2"]
    assert json.loads((tmp_path / FINISHED_FILE).read_text()) == {"0": 3}, "a slot finished on one shard only did not finish"
    new = _resume(tmp_path, _shards(1))
    assert all(torch.equal(a, _params(new)[name]) for name, a in _params(old).items())
    with pytest.raises(ReshardRefused, match="already holds snapshots of 1 shard"):
        reshard_directory(tmp_path, 1)


def test_an_interrupted_reshard_blocks_resume_and_running_it_again_finishes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = _shards(1)
    _train(old, range(2))
    _checkpoint(old, tmp_path)

    def crash(*_: object) -> None:
        raise OSError("killed while moving")

    monkeypatch.setattr(reshard_files, "_move_aside", crash)
    with pytest.raises(OSError):
        reshard_directory(tmp_path, 3)
    assert json.loads((tmp_path / JOURNAL).read_text())["phase"] == "moving"
    with pytest.raises(ResumeRefused, match=r"unfinished rpcps reshard from 1 to 3 .* --shards 3"):
        shard_checkpoint_config(CheckpointConfig(directory=str(tmp_path)), 0, 3)
    with pytest.raises(ReshardRefused, match="unfinished conversion to 3"):
        reshard_directory(tmp_path, 2)
    monkeypatch.undo()
    assert reshard_directory(tmp_path, 3).version == 4
    assert not (tmp_path / JOURNAL).exists() and not list_snapshots(tmp_path)
    new = _resume(tmp_path, _shards(3))
    assert all(torch.equal(a, _params(new)[name]) for name, a in _params(old).items())


def test_a_missing_or_corrupt_shard_is_refused_and_the_directory_left_as_it_was(tmp_path: Path) -> None:
    old = _shards(2)
    _train(old, range(2))
    _checkpoint(old, tmp_path)
    for state in (tmp_path / "shard-1-of-2").glob("step-*/state.pt"):
        state.write_bytes(b"not a snapshot")
    with pytest.raises(ReshardRefused, match=r"no valid snapshot in .*shard-1-of-2 .*truncated"):
        reshard_directory(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-0-of-2", "shard-1-of-2"], "no journal, nothing moved"


@pytest.mark.parametrize(("old_count", "new_count"), [(2, 1), (1, 2)])  # TinyModel has two dense tensors: 2 shards at most
def test_sparse_rows_follow_their_buckets_onto_the_new_shards(tmp_path: Path, old_count: int, new_count: int) -> None:
    old = _train_sharded(old_count, 4)
    _checkpoint(old, tmp_path)
    reshard_directory(tmp_path, new_count)
    fresh = [InProcessServer(TinyModel(), replace(old[0].config, shard_index=k, shard_count=new_count)) for k in range(new_count)]
    new = _resume(tmp_path, fresh)
    merged_old: dict[str, dict[int, torch.Tensor]] = {}
    merged_new: dict[str, dict[int, torch.Tensor]] = {}
    for servers, merged in ((old, merged_old), (new, merged_new)):
        for server in servers:
            for table, rows in _rows(server).items():
                assert not merged.setdefault(table, {}).keys() & rows.keys(), "an id on two servers"
                merged[table].update(rows)
    assert merged_old.keys() == merged_new.keys()
    for table, rows in merged_old.items():
        assert rows.keys() == merged_new[table].keys() and all(torch.equal(r, merged_new[table][i]) for i, r in rows.items())
    assert all(torch.equal(a, _params(new)[name]) for name, a in _params(old).items())


def test_signed_snapshots_need_the_secret_and_the_new_ones_are_signed_with_it(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s" * 40)
    sign = JobSecret.from_file(str(secret)).manifest_signature
    root = tmp_path / "ckpt"
    old = _shards(2)
    _train(old, range(2))
    _checkpoint(old, root, sign=sign)
    with pytest.raises(ReshardRefused, match="is signed .*--sign-checkpoints --job-secret-file"):
        reshard_directory(root, 1)
    reshard_directory(root, 1, verify=sign, sign=sign)
    point = find_resume_point(CheckpointConfig(directory=str(root)), old[0].model_signature, "adam", verify=sign)
    assert point is not None and point[0].version == 4
