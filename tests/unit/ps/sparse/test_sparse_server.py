"""Sparse tables on the server, in-process: pull and push through the worker API, one update per
push (dense and sparse together), a retried push applied once, refusals that change nothing, the
module's gradients equal nn.EmbeddingBag's, and snapshots that restore every row bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from prometheus_client import generate_latest
from torch import nn

from harness.inprocess import InProcessServer, pack
from ps.core.config import ServerCoreConfig
from ps.core.optim import OptimizerConfig
from ps.sparse.store import SparseConfig
from rpcps.errors import PushRejected
from rpcps.messages import PushStatus
from rpcps.sparse.embedding import NotAttached, SparseEmbeddingBagCollection
from rpcps.sparse.row_init import initial_rows
from rpcps.sparse.spec import SparsePull, TableSpec, declared_tables
from worker.sparse_client import SparseRouter

TABLES = (TableSpec(name="user", table_id=0, dim=4), TableSpec(name="item", table_id=1, dim=3))


class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embeddings = SparseEmbeddingBagCollection(TABLES, pooling="sum")
        self.head = nn.Linear(7, 1)

    def forward(self, features: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
        pooled = self.embeddings(features)
        return self.head(torch.cat([pooled["user"], pooled["item"]], dim=1)).squeeze(1)


def _server(**sparse: object) -> InProcessServer:
    config = ServerCoreConfig(optimizer=OptimizerConfig(name="sgd", kwargs={"lr": 0.1}), sparse=SparseConfig(lr=0.5, **sparse))  # type: ignore[arg-type]
    return InProcessServer(TinyModel(), config)


class _Rows:
    """A RowSource straight onto an in-process server (what SparseRouter does over RPC)."""

    def __init__(self, server: InProcessServer, incarnation: str) -> None:
        self.server, self.incarnation = server, incarnation

    def pull(self, request: SparsePull) -> SparsePull:
        return {k: v.float() for k, v in self.server.pull_rows(0, self.incarnation, request).items()}


def _features(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    g = torch.Generator().manual_seed(seed)
    user = torch.randint(-5, 5, (12,), generator=g) * (1 << 40)  # repeats, negative and huge ids
    item = torch.randint(0, 6, (12,), generator=g)
    offsets = torch.tensor([0, 3, 7, 9])
    return {"user": (user, offsets), "item": (item, offsets)}


def _step(server: InProcessServer, model: TinyModel, incarnation: str, seq: int) -> tuple[list[torch.Tensor], dict]:
    for p in model.parameters():
        p.grad = None
    model(_features(seq)).square().sum().backward()
    chunks = pack(server.layout, [p.grad for p in model.parameters()])
    return chunks, model.embeddings.take_grads()


def _rows(server: InProcessServer) -> dict[str, dict[int, torch.Tensor]]:
    """Every live row per table, by id (read through pulls would create rows, so read the captures)."""
    out = {}
    for name, fulls in server.sparse.capture().items():
        out[name] = {}
        for full in fulls:
            ids, rows = full["records"]["ids"], full["records"]["rows"]
            out[name].update({int(i): r.clone() for i, r in zip(ids, rows)})
    return out


def test_server_declares_the_models_tables_and_refuses_sync_mode() -> None:
    assert declared_tables(TinyModel()) == TABLES
    assert sorted(_server().sparse.tables) == ["item", "user"]
    with pytest.raises(ValueError, match="async or bounded"):
        InProcessServer(TinyModel(), ServerCoreConfig(mode="sync"))


def test_module_needs_a_row_source() -> None:
    with pytest.raises(NotAttached):
        TinyModel()(_features(0))


def test_module_grads_are_nn_embedding_bags_summed_per_unique_id() -> None:
    server = _server()
    incarnation = server.register(0, "w0", server.signature.to_wire()).incarnation
    model = TinyModel()
    model.embeddings.attach(_Rows(server, incarnation))
    features = _features(3)
    out = model.embeddings(features)
    (out["user"].sum(dim=1) * torch.arange(4.0)).sum().backward()
    grads = model.embeddings.take_grads()
    ids, offsets = features["user"]
    unique = torch.unique(ids)
    bag = nn.EmbeddingBag(unique.numel(), 4, mode="sum")
    with torch.no_grad():
        bag.weight.copy_(server.pull_rows(0, incarnation, {"user": unique})["user"])
    expected = bag(torch.searchsorted(unique, ids), offsets)
    assert torch.allclose(expected, out["user"].detach())
    (expected.sum(dim=1) * torch.arange(4.0)).sum().backward()
    assert torch.equal(grads["user"][0], unique)
    assert torch.equal(grads["user"][1], bag.weight.grad)
    looked_up = sum(ids.numel() for ids, _ in features.values())
    distinct = sum(torch.unique(ids).numel() for ids, _ in features.values())
    assert model.embeddings.take_lookup_counts() == (looked_up, distinct) and distinct < looked_up
    assert model.embeddings.take_lookup_counts() == (0, 0)  # taken: reset
    with torch.no_grad():
        model.embeddings(features)
    assert model.embeddings.take_lookup_counts() == (0, 0)  # evaluation lookups are not counted


def test_push_applies_dense_and_sparse_once_and_a_retry_is_a_duplicate() -> None:
    server = _server()
    incarnation = server.register(0, "w0", server.signature.to_wire()).incarnation
    model = TinyModel()
    model.embeddings.attach(_Rows(server, incarnation))
    chunks, sparse = _step(server, model, incarnation, 0)
    assert _rows(server) == {"user": {}, "item": {}}  # the pull admitted the ids; the update creates their rows
    assert server.push(0, incarnation, 0, 0, chunks, 1.0, sparse).status == PushStatus.APPLIED
    after = _rows(server)
    ids, grads = sparse["user"]
    table = server.sparse.tables["user"].config
    before = initial_rows(table.init, table.table_id, ids, table.dim)  # what the pull read
    assert sorted(after["user"]) == sorted(ids.tolist())
    for i, g, pulled in zip(ids.tolist(), grads, before):
        if bool(g.abs().sum() > 0):
            assert not torch.equal(after["user"][i][:4], pulled)
    # A retry of the same (slot, step) is answered duplicate and changes neither part.
    masters = server.master_tensors()
    assert server.push(0, incarnation, 0, 0, chunks, 1.0, sparse).status == PushStatus.DUPLICATE
    assert all(torch.equal(a, b) for a, b in zip(masters.values(), server.master_tensors().values()))
    again = _rows(server)
    assert all(torch.equal(after[t][i], again[t][i]) for t in after for i in after[t])
    assert server.version == 1


@pytest.mark.parametrize(
    "spoil, match",
    [
        (lambda s: {"nope": s["user"]}, "unknown sparse table"),
        (lambda s: {"user": (s["user"][0].int(), s["user"][1])}, "int64"),
        (lambda s: {"user": (s["user"][0], s["user"][1][:, :2].contiguous())}, "shape"),
        (lambda s: {"user": (torch.cat([s["user"][0], s["user"][0][:1]]), torch.cat([s["user"][1], s["user"][1][:1]]))}, "repeats"),
        (lambda s: {"user": (s["user"][0], s["user"][1].clone().fill_(float("nan")))}, "NaN"),
        (lambda s: [s["user"]], "dict"),
    ],
)
def test_bad_sparse_parts_are_refused_and_change_nothing(spoil, match) -> None:  # type: ignore[no-untyped-def]
    server = _server()
    incarnation = server.register(0, "w0", server.signature.to_wire()).incarnation
    model = TinyModel()
    model.embeddings.attach(_Rows(server, incarnation))
    chunks, sparse = _step(server, model, incarnation, 0)
    before, masters = _rows(server), server.master_tensors()
    with pytest.raises(PushRejected, match=match):
        server.push(0, incarnation, 0, 0, chunks, 1.0, spoil(sparse))
    assert server.version == 0
    assert all(torch.equal(a, b) for a, b in zip(masters.values(), server.master_tensors().values()))
    after = _rows(server)
    assert all(torch.equal(before[t][i], after[t][i]) for t in before for i in before[t])


def test_ids_of_another_shard_are_refused() -> None:
    config = ServerCoreConfig(shard_index=0, shard_count=2)
    server = InProcessServer(TinyModel(), config)
    incarnation = server.register(0, "w0", server.model_signature.to_wire()).incarnation
    with pytest.raises(PushRejected, match="another server owns"):
        server.pull_rows(0, incarnation, {"user": torch.arange(64)})


def test_router_splits_by_owning_shard_and_reassembles_in_order() -> None:
    class Shard:
        def __init__(self, index: int) -> None:
            self.index = index
            self.seen: list[torch.Tensor] = []

        def pull_rows(self, request: SparsePull) -> SparsePull:
            self.seen.append(request["user"])
            return {"user": request["user"].double().unsqueeze(1).expand(-1, 4).clone()}

    shards = [Shard(0), Shard(1), Shard(2)]
    router = SparseRouter(TABLES, 3, torch.float32, lambda parts: [s.pull_rows(p) for s, p in zip(shards, parts)])
    ids = torch.arange(200) * 7919
    rows = router.pull({"user": ids})["user"]
    assert torch.equal(rows[:, 0], ids.float())
    owners = router.manifest.server_of(ids, 0)
    for s in shards:
        assert torch.equal(s.seen[0], ids[owners == s.index])
    parts = router.split_push({"user": (ids, torch.ones(200, 4))})
    assert sum(p["user"][0].numel() for p in parts) == 200


def test_snapshot_restores_rows_optimizer_state_and_progress_exactly() -> None:
    server = _server(admit_count=2)
    incarnation = server.register(0, "w0", server.signature.to_wire()).incarnation
    model = TinyModel()
    model.embeddings.attach(_Rows(server, incarnation))
    for seq in range(6):
        chunks, sparse = _step(server, model, incarnation, seq)
        assert server.push(0, incarnation, seq, server.version, chunks, 1.0, sparse).status == PushStatus.APPLIED
    version, state = server.capture_state()
    restored = _server(admit_count=2)
    restored.restore_state(state)
    assert restored.version == version == 6
    a, b = _rows(server), _rows(restored)
    assert a.keys() == b.keys() and all(a[t].keys() == b[t].keys() for t in a)
    assert all(torch.equal(a[t][i], b[t][i]) for t in a for i in a[t])  # rows and row-wise Adagrad state
    # The restored server still knows step 5 was applied: a retry after the restart is a duplicate.
    incarnation = restored.register(0, "w0", restored.signature.to_wire()).incarnation
    assert restored.push(0, incarnation, 5, 6, chunks, 1.0, sparse).status == PushStatus.DUPLICATE


def test_snapshot_of_other_tables_is_refused() -> None:
    server = _server()
    _, state = server.capture_state()
    state["sparse"] = {"user": state["sparse"]["user"]}
    with pytest.raises(ValueError, match="sparse tables"):
        _server().restore_state(state)


def test_metrics_show_each_tables_rows_and_traffic() -> None:
    server = _server(admit_count=2)
    incarnation = server.register(0, "w0", server.signature.to_wire()).incarnation
    model = TinyModel()
    model.embeddings.attach(_Rows(server, incarnation))
    for seq in range(3):
        chunks, sparse = _step(server, model, incarnation, seq)
        server.push(0, incarnation, seq, server.version, chunks, 1.0, sparse)
    server.capture_state()
    text = generate_latest(server.core.metrics.registry).decode()
    stats = server.sparse.stats()["user"]
    assert stats.rows > 0 and stats.filtered_total > 0
    assert f'rpcps_sparse_rows{{table="user"}} {float(stats.rows)}' in text
    assert f'rpcps_sparse_filtered_ids_total{{table="user"}} {float(stats.filtered_total)}' in text
    assert f'rpcps_sparse_pushed_rows_total{{table="item"}} {float(server.sparse.stats()["item"].pushed_rows_total)}' in text
    assert 'rpcps_sparse_push_lookups_reused_total{table="user"} 3.0' in text  # each push took its pull's rows
    assert 'rpcps_sparse_push_lookups_fallback_total{table="user"} 0.0' in text
    assert "rpcps_sparse_checkpoint_pause_seconds_count 1.0" in text


def _train_sharded(
    shards: int, steps: int, after_step: Callable[[list[InProcessServer], int], object] = lambda servers, seq: None
) -> list[InProcessServer]:
    """One worker, ``steps`` steps, each pushed to every shard and applied before the next pull;
    ``after_step(servers, seq)`` runs after each."""
    servers = [
        InProcessServer(TinyModel(), ServerCoreConfig(optimizer=OptimizerConfig(name="sgd", kwargs={"lr": 0.1}),
                                                      sparse=SparseConfig(lr=0.5), shard_index=k, shard_count=shards))
        for k in range(shards)
    ]
    incarnations = [s.register(0, "w0", s.model_signature.to_wire()).incarnation for s in servers]
    model = TinyModel()
    router = SparseRouter(TABLES, shards, torch.float32, lambda parts: [
        s.pull_rows(0, i, p) for s, i, p in zip(servers, incarnations, parts)
    ])
    model.embeddings.attach(router)
    for seq in range(steps):
        params = dict(model.named_parameters())
        for server in servers:  # the dense parameters each shard owns, as the trainer's pull loads them
            with torch.no_grad():
                for name, value in server.master_tensors().items():
                    params[name].copy_(value)
        for p in model.parameters():
            p.grad = None
        model(_features(seq)).square().sum().backward()
        parts = router.split_push(model.embeddings.take_grads())
        for server, incarnation, part in zip(servers, incarnations, parts):
            grads = [params[slot.spec.name].grad for slot in server.layout.slots]
            reply = server.push(0, incarnation, seq, server.version, pack(server.layout, grads), 1.0, part)
            assert reply.status == PushStatus.APPLIED
        after_step(servers, seq)
    return servers


def test_each_shard_is_pushed_exactly_the_ids_it_was_pulled_so_no_push_repeats_the_lookup() -> None:
    """SparseRouter splits a step's pull and its push by the same manifest, so every push's ids equal
    its pull's on every shard, and the table takes the pull's rows (ps/sparse/pull_memo.py)."""
    for server in _train_sharded(2, 4):
        for name, s in server.sparse.stats().items():
            assert (s.push_lookups_reused_total, s.push_lookups_fallback_total) == (4, 0), name


def test_two_shards_hold_disjoint_rows_bit_identical_to_one_server() -> None:
    one = _rows(_train_sharded(1, 5)[0])
    two = [_rows(s) for s in _train_sharded(2, 5)]
    for table in one:
        assert two[0][table] and two[1][table], "both shards hold some of the table"
        assert two[0][table].keys().isdisjoint(two[1][table].keys()), "an id has a row on both shards"
        merged = {**two[0][table], **two[1][table]}
        assert merged.keys() == one[table].keys()
        assert all(torch.equal(merged[i], one[table][i]) for i in merged), f"table {table}: rows differ from one server's"
