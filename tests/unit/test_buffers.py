"""Model buffers (BatchNorm statistics): in the signature, carried by pushes, kept by the server in update
order, handed back by pulls, snapshotted and restored; a worker that pulls every step matches one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.inprocess import InProcessServer, pack
from ps.checkpoints.checkpointer import _check_compatible
from ps.core.config import ServerCoreConfig
from ps.core.optim import OptimizerConfig
from rpcps.errors import PushRejected, SignatureMismatch
from rpcps.messages import PushStatus
from rpcps.partition import partition_digest, shard_signature
from rpcps.signature import ModelSignature
from worker.buffers import ModelBuffers
from worker.device import load_parameters

SGD = OptimizerConfig(name="sgd", kwargs={"lr": 0.1})


def bn_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    model.register_buffer("constant", torch.ones(2), persistent=False)  # not in state_dict: not synced
    return model


def plain_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 6, generator=g) * 3 + 1, torch.randint(0, 3, (16,), generator=g)


def make(model: nn.Module, **core: object) -> InProcessServer:
    return InProcessServer(model, ServerCoreConfig(optimizer=SGD, chunk_bytes=1024, **core))  # type: ignore[arg-type]


def test_signature_holds_persistent_buffers_with_their_dtypes() -> None:
    sig = ModelSignature.of_module(bn_model())
    assert [(b.name, b.dtype) for b in sig.buffers] == [
        ("1.running_mean", "float32"), ("1.running_var", "float32"), ("1.num_batches_tracked", "int64"),
    ]
    assert ModelSignature.from_wire(sig.to_wire()) == sig


def test_a_model_without_buffers_has_the_signature_and_digest_it_had_before_buffers() -> None:
    sig = ModelSignature.of_module(plain_model())
    assert sig.buffers == () and all(len(item) == 3 for item in sig.to_wire())
    with_buffers = ModelSignature.of_module(bn_model())
    assert with_buffers.digest() != ModelSignature(with_buffers.params).digest()
    # The partition (and its digest, recorded in snapshots) depends on parameters only.
    assert partition_digest(with_buffers, 2) == partition_digest(ModelSignature(with_buffers.params), 2)


def test_shard_zero_holds_every_buffer() -> None:
    sig = ModelSignature.of_module(bn_model())
    assert shard_signature(sig, 2, 0).buffers == sig.buffers
    assert shard_signature(sig, 2, 1).buffers == ()


def test_registration_with_different_buffers_is_refused_naming_the_buffer() -> None:
    server = make(bn_model())
    worker = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, track_running_stats=False), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(SignatureMismatch, match="buffer '1.running_mean' is missing from the worker's model"):
        server.register(0, "w", ModelSignature.of_module(worker).to_wire())


def _register(server: InProcessServer, model: nn.Module) -> str:
    return server.register(0, "w", ModelSignature.of_module(model).to_wire()).incarnation


def _push(server: InProcessServer, incarnation: str, seq: int, buffers: list[torch.Tensor]) -> PushStatus:
    chunks = pack(server.layout, [torch.full(s.spec.shape, 0.01) for s in server.layout.slots])
    return server.push(0, incarnation, seq, server.version, [*chunks, *buffers]).status


def test_a_push_carries_buffers_that_the_next_pull_returns_in_their_own_dtypes() -> None:
    model = bn_model()
    server = make(model)
    incarnation = _register(server, model)
    first = server.pull(0, incarnation, -1)
    assert [b.dtype for b in first.buffers] == [torch.float32, torch.float32, torch.int64]
    pushed = [torch.full((8,), 0.5), torch.full((8,), 2.0), torch.tensor(7, dtype=torch.int64)]
    assert _push(server, incarnation, 0, pushed) == PushStatus.APPLIED
    pulled = server.pull(0, incarnation, first.version).buffers
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(pulled, pushed))
    assert server.pull(0, incarnation, server.version).buffers is None  # unchanged: nothing sent


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([torch.zeros(8), torch.ones(8), torch.tensor(1.0)], "num_batches_tracked' has dtype torch.float32, expected int64"),
        ([torch.zeros(9), torch.ones(8), torch.tensor(1)], "running_mean' has shape \\[9\\], expected \\[8\\]"),
        ([torch.zeros(8), torch.full((8,), float("nan")), torch.tensor(1)], "running_var' holds NaN/Inf"),
    ],
)
def test_bad_buffers_refuse_the_push_and_change_nothing(bad: list[torch.Tensor], message: str) -> None:
    model = bn_model()
    server = make(model)
    incarnation = _register(server, model)
    version, before = server.model_state()
    with pytest.raises(PushRejected, match=message):
        _push(server, incarnation, 0, bad)
    assert server.version == version
    after = server.model_state()[1]
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_nonfinite_buffers_are_skipped_under_on_nonfinite_skip() -> None:
    model = bn_model()
    server = make(model, on_nonfinite="skip")
    incarnation = _register(server, model)
    bad = [torch.zeros(8), torch.full((8,), float("inf")), torch.tensor(1)]
    assert _push(server, incarnation, 0, bad) == PushStatus.SKIPPED
    assert server.version == 0


def test_a_model_without_buffers_pushes_exactly_its_gradient_chunks() -> None:
    model = plain_model()
    server = make(model)
    incarnation = _register(server, model)
    assert not server.buffers and server.pull(0, incarnation, -1).buffers is None
    assert _push(server, incarnation, 0, []) == PushStatus.APPLIED
    with pytest.raises(PushRejected, match="gradient chunks"):
        _push(server, incarnation, 1, [torch.zeros(1)])


def test_snapshots_hold_buffers_and_restore_them() -> None:
    model = bn_model()
    server = make(model)
    incarnation = _register(server, model)
    _push(server, incarnation, 0, [torch.full((8,), 0.5), torch.full((8,), 2.0), torch.tensor(7)])
    _, state = server.capture_state()
    restored = make(bn_model())
    restored.restore_state(state)
    assert {k: v.tolist() for k, v in restored.model_state()[1].items()} == {k: v.tolist() for k, v in server.model_state()[1].items()}
    older = {k: v for k, v in state.items() if k != "buffers"}  # a snapshot from before buffers were kept
    fresh = make(bn_model())
    fresh.restore_state(older)
    assert int(fresh.model_state()[1]["1.num_batches_tracked"]) == 0


def test_resume_accepts_a_snapshot_from_before_buffers_but_not_other_buffers(tmp_path: object) -> None:
    sig = ModelSignature.of_module(bn_model())
    manifest = {"signature": ModelSignature(sig.params).to_wire(), "optimizer": "sgd"}
    _check_compatible(tmp_path, manifest, sig, "sgd")  # type: ignore[arg-type]
    other = ModelSignature(sig.params, sig.buffers[:2])
    with pytest.raises(ValueError, match="buffer '1.num_batches_tracked' is missing from the snapshot"):
        _check_compatible(tmp_path, {**manifest, "signature": other.to_wire()}, sig, "sgd")  # type: ignore[arg-type]


def test_one_worker_pulling_every_step_trains_parameters_and_statistics_as_one_process() -> None:
    server_model, worker_model, reference = bn_model(), bn_model(), bn_model()
    server = make(server_model)
    signature = ModelSignature.of_module(worker_model)
    buffers = ModelBuffers(worker_model, signature)
    params = [p for p in worker_model.parameters() if p.requires_grad]
    incarnation = server.register(0, "w", signature.to_wire()).incarnation
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    version = -1
    for step in range(6):
        reply = server.pull(0, incarnation, version)
        load_parameters(server.layout, params, reply.chunks)
        buffers.load(reply.buffers)
        version = reply.version
        inputs, targets = batch(step)
        for p in params:
            p.grad = None
        nn.functional.cross_entropy(worker_model(inputs), targets).backward()
        grads = pack(server.layout, [p.grad for p in params])
        assert server.push(0, incarnation, step, version, [*grads, *buffers.for_push()]).status == PushStatus.APPLIED
        optimizer.zero_grad()
        nn.functional.cross_entropy(reference(inputs), targets).backward()
        optimizer.step()
    _, held = server.model_state()
    expected = reference.state_dict()
    assert held.keys() == expected.keys() and int(held["1.num_batches_tracked"]) == 6
    for name, value in held.items():
        torch.testing.assert_close(value, expected[name], msg=name)
