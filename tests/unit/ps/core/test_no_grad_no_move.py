"""No gradient, no move: a parameter a push has no gradient for keeps its value and optimizer state,
as ``torch.optim`` skips a parameter whose ``.grad`` is None (``ps.core.presence``), on the server, on a
standby fed the log, across a snapshot, in a sync round, and in what the worker's stager reports."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.inprocess import assert_bit_identical, grads_like, make_server, pack
from ps.core.optim import OPTIMIZERS, OptimizerConfig, torch_kwargs
from ps.core.presence import check_absent
from ps.core.update_log import Sequenced
from rpcps.errors import PushRejected
from rpcps.signature import FlatLayout, ModelSignature
from rpcps.sparse.embedding import SparseEmbeddingBagCollection
from rpcps.sparse.spec import TableSpec
from worker.device import GradientStager

ADAM_WD = OptimizerConfig(name="adam", kwargs={"lr": 1e-2, "weight_decay": 0.1})
UNUSED = (2, 3)
"""Parameters (signature order) of the test model that get no gradient: the middle Linear."""


def _absent(indices: tuple[int, ...] = UNUSED) -> int:
    return sum(1 << i for i in indices)


def _without(grads: list[torch.Tensor], indices: tuple[int, ...] = UNUSED) -> list[torch.Tensor]:
    return [torch.zeros_like(g) if i in indices else g for i, g in enumerate(grads)]


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd", "rmsprop", "adagrad"])
def test_an_unused_branch_stays_bit_identical_and_the_rest_steps_as_torch_optim_does(name: str) -> None:
    config = ADAM_WD if name == "adam" else OptimizerConfig(name=name, kwargs={"lr": 1e-2, "weight_decay": 0.1, **(
        {"momentum": 0.9} if name in ("sgd", "rmsprop") else {})})
    server, model = make_server(config)
    before = server.master_tensors()
    incarnation = server.register(0, "w0", server.signature.to_wire()).incarnation
    reference = OPTIMIZERS[name](model.parameters(), **torch_kwargs(server.config.applied_optimizer))  # async's betas
    params = list(model.parameters())
    for seq in range(8):
        grads = grads_like(model, seq)
        reply = server.push(0, incarnation, seq, server.version, pack(server.layout, _without(grads)), 1.0, absent=_absent())
        assert reply.status == "applied"
        for i, (p, g) in enumerate(zip(params, grads)):
            p.grad = None if i in UNUSED else g.clone()
        reference.step()
    got = server.master_tensors()
    names = [n for n, _ in model.named_parameters()]
    for i in UNUSED:
        assert torch.equal(got[names[i]], before[names[i]]), f"{names[i]} moved without a gradient"
    moved = [n for i, n in enumerate(names) if i not in UNUSED and not torch.equal(got[n], before[n])]
    assert len(moved) == len(names) - len(UNUSED), "the used parameters must move, or the test proves nothing"
    assert_bit_identical(got, {n: p.detach() for n, p in model.named_parameters()})


def test_without_a_mask_an_unused_branch_would_move() -> None:
    """The defect the mask fixes: zeros are a gradient to Adam with weight decay."""
    server, model = make_server(ADAM_WD)
    before = server.master_tensors()
    incarnation = server.register(0, "w0", server.signature.to_wire()).incarnation
    server.push(0, incarnation, 0, 0, pack(server.layout, _without(grads_like(model, 0))), 1.0)
    name = [n for n, _ in model.named_parameters()][UNUSED[0]]
    assert not torch.equal(server.master_tensors()[name], before[name])


def test_a_standby_and_a_resumed_server_apply_the_mask_identically() -> None:
    primary, model = make_server(ADAM_WD)
    standby, _ = make_server(ADAM_WD)
    standby.core.mirroring = True
    primary.core.log.retain_from = 1
    incarnation = primary.register(0, "w0", primary.signature.to_wire()).incarnation
    for seq in range(6):
        absent = _absent() if seq % 2 else _absent((0,))
        primary.push(0, incarnation, seq, primary.version, pack(primary.layout, grads_like(model, seq)), 1.0, absent=absent)
        if seq == 2:
            _, state = primary.core.capture_state()
    for sequenced in primary.core.log.entries_from(1, 1 << 40):
        with standby.core.lock:
            standby.core.log.append(Sequenced(sequenced.entry))
            standby.core.apply_committed_locked()
    with primary.core.lock, standby.core.lock:
        assert primary.core.digest_locked() == standby.core.digest_locked()
    # A server resumed from the snapshot taken after step 2 replays steps 3..5 to the same state.
    resumed, _ = make_server(ADAM_WD)
    resumed.core.restore_state(state)
    incarnation = resumed.register(0, "w0", resumed.signature.to_wire()).incarnation
    for seq in range(3, 6):
        absent = _absent() if seq % 2 else _absent((0,))
        resumed.push(0, incarnation, seq, resumed.version, pack(resumed.layout, grads_like(model, seq)), 1.0, absent=absent)
    with primary.core.lock, resumed.core.lock:
        assert resumed.core.version == primary.core.version
    assert_bit_identical(resumed.master_tensors(), primary.master_tensors())


def test_a_sync_round_leaves_only_what_no_contribution_had_a_gradient_for() -> None:
    server, model = make_server(ADAM_WD, mode="sync", min_workers=2)
    before = server.master_tensors()
    incarnations = [server.register(slot, f"w{slot}", server.signature.to_wire()).incarnation for slot in (0, 1)]
    futures = [
        server.submit(0, incarnations[0], 0, 0, pack(server.layout, grads_like(model, 0)), 1.0, absent=_absent((2, 3, 4))),
        server.submit(1, incarnations[1], 0, 0, pack(server.layout, grads_like(model, 1)), 1.0, absent=_absent((2, 3))),
    ]
    assert [f.wait().status for f in futures] == ["applied", "applied"]
    got = server.master_tensors()
    names = [n for n, _ in model.named_parameters()]
    assert [torch.equal(got[n], before[n]) for n in names] == [False, False, True, True, False, False]


@pytest.mark.parametrize("absent", [-1, 1 << 6, 1.5, "3"])
def test_a_mask_naming_parameters_the_shard_lacks_is_refused(absent: object) -> None:
    server, model = make_server(ADAM_WD)
    before = server.master_tensors()
    incarnation = server.register(0, "w0", server.signature.to_wire()).incarnation
    with pytest.raises(PushRejected, match="presence mask"):
        server.push(0, incarnation, 0, 0, pack(server.layout, grads_like(model, 0)), 1.0, absent=absent)  # type: ignore[arg-type]
    assert_bit_identical(server.master_tensors(), before)
    assert check_absent(0b111111, 6) is None


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 3)
        self.unused = nn.Linear(4, 3)
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.used(x)))


def _stager(model: nn.Module) -> tuple[GradientStager, list[torch.Tensor]]:
    params = list(model.parameters())
    stager = GradientStager(FlatLayout(ModelSignature.of_module(model)), params, torch.device("cpu"))
    return stager, stager.new_buffers()


def test_the_stager_reports_parameters_backward_did_not_reach_when_bound() -> None:
    model = _Branchy()
    stager, buffers = _stager(model)
    assert stager.direct
    for _ in range(2):  # the flags are reset by every bind
        stager.bind(buffers)
        model(torch.randn(5, 4)).sum().backward()
        assert stager.absent_bound(buffers) == _absent((2, 3))


def test_a_grad_the_user_replaced_after_bind_is_copied_into_the_buffers() -> None:
    model = _Branchy()
    stager, buffers = _stager(model)
    stager.bind(buffers)
    model.zero_grad(set_to_none=True)  # unbinds the views: backward makes tensors of its own
    model(torch.randn(5, 4)).sum().backward()
    assert stager.absent_bound(buffers) == _absent((2, 3))
    views = stager.layout.views(buffers)
    for view, p in zip(views, model.parameters()):
        assert torch.equal(view, p.grad if p.grad is not None else torch.zeros_like(view))


def test_the_stager_reports_parameters_without_grad_when_staging() -> None:
    model = _Branchy()
    stager, buffers = _stager(model)
    model(torch.randn(5, 4)).sum().backward()
    assert stager.stage(buffers) == _absent((2, 3))


class _Rows:
    """A RowSource whose rows are 1.0 (the values do not matter here, only the gradients)."""

    def pull(self, request: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: torch.ones(len(ids), 2) for name, ids in request.items()}


def test_sparse_rows_sum_over_micro_batches_and_a_table_without_gradient_is_left_out() -> None:
    tables = SparseEmbeddingBagCollection([TableSpec(name="a", table_id=0, dim=2), TableSpec(name="b", table_id=1, dim=2)])
    tables.attach(_Rows())
    for ids in ([1, 2], [2, 3]):  # two micro-batches, one bag each; table b's output is not used
        out = tables({"a": (torch.tensor(ids), torch.tensor([0])), "b": (torch.tensor([7]), torch.tensor([0]))})
        out["a"].sum().backward()
    grads = tables.take_grads()
    assert set(grads) == {"a"}, "rows that got no gradient are not pushed (they would move)"
    ids, rows = grads["a"]
    assert ids.tolist() == [1, 2, 3] and rows[:, 0].tolist() == [1.0, 2.0, 1.0]
    assert tables.take_grads() == {}
