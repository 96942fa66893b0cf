"""Partitioning, sync rounds, bounded staleness and sharding, in-process (no RPC)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from harness.inprocess import InProcessServer
from ps.api.sync_rounds import RoundKeeper, SyncContribution
from ps.core.config import ServerCoreConfig
from ps.core.optim import OptimizerConfig
from ps.core.server import Contribution
from ps.core.workers import WorkerRecord
from rpcps.partition import imbalance, partition, partition_digest
from rpcps.signature import FlatLayout, ModelSignature
from rpcps.tasks import mlp_25m, teacher_student_data, teacher_student_model

SGD = OptimizerConfig(name="sgd", kwargs={"lr": 0.1})


def test_partition_is_deterministic_complete_and_balanced() -> None:
    sig = ModelSignature.of_module(mlp_25m())
    for shards in (1, 2, 3, 4):
        parts = partition(sig, shards)
        assert parts == partition(sig, shards)
        assert sorted(i for p in parts for i in p) == list(range(len(sig.params)))
    assert imbalance(sig, 2) < 1.01 and imbalance(sig, 3) < 1.01
    assert partition_digest(sig, 2) != partition_digest(sig, 3)


def test_partition_refuses_more_shards_than_tensors() -> None:
    sig = ModelSignature.of_module(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="at most 2"):
        partition(sig, 3)


def _contribution(slot: int) -> SyncContribution:
    return SyncContribution(Contribution(WorkerRecord(slot, f"w{slot}", "x"), 0, None, 0), object())


def test_round_waits_for_every_live_worker_then_closes() -> None:
    keeper = RoundKeeper((3,), timeout_s=10)
    assert keeper.add({0, 1}, _contribution(0), [torch.ones(3)])
    assert not keeper.ready(time.monotonic())
    assert keeper.add({0, 1}, _contribution(1), [torch.full((3,), 3.0)])
    assert keeper.ready(time.monotonic())
    round_, waiting = keeper.take()
    assert torch.equal(round_.sums[0], torch.full((3,), 4.0)) and waiting == []


def test_round_closes_without_a_dead_worker_and_after_the_timeout() -> None:
    keeper = RoundKeeper((1,), timeout_s=5)
    keeper.add({0, 1, 2}, _contribution(0), [torch.ones(1)])
    keeper.drop(2)  # the reaper found it dead
    assert not keeper.ready(time.monotonic())
    assert keeper.ready(time.monotonic() + 6), "slot 1 never came: the timeout closes the round"


def test_a_worker_joining_mid_round_waits_for_the_next() -> None:
    keeper = RoundKeeper((1,), timeout_s=5)
    keeper.add({0}, _contribution(0), [torch.ones(1)])
    late = _contribution(7)
    assert not keeper.add({0, 7}, late, [torch.ones(1)])
    _, waiting = keeper.take()
    assert waiting == [late.reply]


def _sync_server(model: nn.Module, **kw: object) -> InProcessServer:
    return InProcessServer(model, ServerCoreConfig(optimizer=SGD, mode="sync", round_timeout_s=30, **kw))  # type: ignore[arg-type]


def _grads(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    model.zero_grad()
    nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _load(model: nn.Module, server: InProcessServer) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(server.master_tensors()[n])


def _flat(server: InProcessServer, grads: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    chunks = server.layout.empty_chunks()
    for view, slot in zip(server.layout.views(chunks), server.layout.slots):
        view.copy_(grads[slot.spec.name])
    return chunks


def test_sync_rounds_equal_single_process_sgd_on_the_global_batch() -> None:
    server = _sync_server(teacher_student_model())
    regs = [server.register(s, f"w{s}", server.model_signature.to_wire()) for s in (0, 1)]
    workers = [teacher_student_model(), teacher_student_model()]
    reference = teacher_student_model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    data = [teacher_student_data(0, 2), teacher_student_data(1, 2)]
    for step in range(5):
        batches = [d.batch(step) for d in data]
        futures = []
        for slot, (model, batch) in enumerate(zip(workers, batches)):
            _load(model, server)
            futures.append(server.submit(slot, regs[slot].incarnation, step, server.version, _flat(server, _grads(model, batch))))
        assert [f.wait().status for f in futures] == ["applied", "applied"]
        whole = (torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
        optimizer.zero_grad()
        nn.functional.cross_entropy(reference(whole[0]), whole[1]).backward()
        optimizer.step()
    assert server.version == 5 and server.stats.rounds == 5
    for name, p in reference.named_parameters():
        torch.testing.assert_close(server.master_tensors()[name], p.detach(), rtol=1e-5, atol=1e-6)


def test_sharded_sync_equals_unsharded_step_for_step() -> None:
    whole = _sync_server(teacher_student_model())
    shards = [_sync_server(teacher_student_model(), shard_index=k, shard_count=2) for k in (0, 1)]
    servers = [whole, *shards]
    regs = [[s.register(slot, f"w{slot}", s.model_signature.to_wire()).incarnation for slot in (0, 1)] for s in servers]
    models = [teacher_student_model(), teacher_student_model()]
    data = [teacher_student_data(0, 2), teacher_student_data(1, 2)]
    for step in range(4):
        grads = []
        for slot, model in enumerate(models):
            _load(model, whole)
            grads.append(_grads(model, data[slot].batch(step)))
        for server, incarnations in zip(servers, regs):
            futures = [server.submit(slot, incarnations[slot], step, server.version, _flat(server, g)) for slot, g in enumerate(grads)]
            assert all(f.wait().status == "applied" for f in futures)
        merged = {**shards[0].master_tensors(), **shards[1].master_tensors()}
        assert merged.keys() == whole.master_tensors().keys()
        for name, tensor in whole.master_tensors().items():
            assert torch.equal(tensor, merged[name]), f"step {step}: {name}"


def test_bounded_mode_never_applies_a_gradient_beyond_k() -> None:
    server = InProcessServer(teacher_student_model(), ServerCoreConfig(optimizer=SGD, mode="bounded", max_staleness=2))
    inc = server.register(0, "w0", server.model_signature.to_wire()).incarnation
    zeros = [torch.zeros(n) for n in server.layout.chunk_numels]
    for seq in range(20):
        base = max(server.version - (seq % 5), 0)  # staleness 0..4
        staleness = server.version - base
        reply = server.push(0, inc, seq, base, zeros)
        assert reply.status == ("applied" if staleness <= 2 else "stale"), (seq, staleness)
    assert server.stats.max_staleness <= 2 and server.stats.pushes_stale > 0
    assert server.stats.updates_applied + server.stats.pushes_stale == 20


def test_shard_layouts_cover_the_model_once() -> None:
    model = teacher_student_model()
    sig = ModelSignature.of_module(model)
    names = []
    for k in range(3):
        server = InProcessServer(model, ServerCoreConfig(shard_index=k, shard_count=3))
        names += [s.spec.name for s in FlatLayout(server.signature).slots]
    assert sorted(names) == sorted(p.name for p in sig.params)


def test_after_a_death_new_sync_rounds_need_only_the_live_workers() -> None:
    server = _sync_server(teacher_student_model(), min_workers=2)
    r0, r1 = (server.register(s, f"w{s}", server.model_signature.to_wire()).incarnation for s in (0, 1))
    zeros = [torch.zeros(n) for n in server.layout.chunk_numels]
    first = [server.submit(0, r0, 0, 0, zeros), server.submit(1, r1, 0, 0, zeros)]
    assert all(f.wait().status == "applied" for f in first)
    server.mark_dead(1, r1)
    started = time.monotonic()
    assert server.submit(0, r0, 1, 1, zeros).wait().status == "applied"
    assert time.monotonic() - started < 5, "a round must not wait the 30 s timeout for min_workers after a death"
    asked = server.submit(0, r0, 2, 2, zeros, have_version=2).wait()  # the reply brings the round's result
    assert asked.status == "applied" and asked.pulled is not None and asked.pulled.version == server.version == 3
