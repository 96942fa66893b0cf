"""Sparse tables through the replication log, in-process: a standby that applies its primary's
entries holds bit-identical rows (admission by count, rows created by pulls, eviction decisions, the
row optimizer's state) at every version; a standby started from a state copied in slices while
training went on catches up to the same digest; and the digest sees a single changed row."""

from __future__ import annotations

import torch

from harness.inprocess import InProcessServer, pack
from ps.core.update_log import Sequenced
from ps.sparse.store import payloads
from rpcps.messages import Evicted, PushStatus, Update
from tests.unit.ps.sparse.test_sparse_server import TinyModel, _Rows, _server

SETTINGS = {"admit_count": 2, "ttl": 3}
"""An id gets a row at its second pull, and rows not updated for 3 of their table's updates go."""


class Follower:
    """A standby in-process: started from a state, it applies its primary's entries after ``index``."""

    def __init__(self, state: dict, index: int) -> None:
        self.server = _server(**SETTINGS)
        self.server.restore_state(state)
        self.server.core.mirroring = True
        self.index = index

    def follow(self, primary: InProcessServer) -> None:
        for sequenced in primary.log.entries_from(self.index + 1, 1 << 30):
            self.server.log.append(Sequenced(sequenced.entry))
            self.index = sequenced.index
        with self.server.lock:
            self.server.apply_committed_locked()

    def digest(self) -> str:
        with self.server.lock:
            return self.server.digest_locked()


def _primary() -> InProcessServer:
    server = _server(**SETTINGS)
    server.log.retain_from = 1  # as with a follower attached: every entry stays readable
    return server


def _transfer(primary: InProcessServer) -> Follower:
    """A state transfer as ``ps.replication.primary.Primary.attach`` takes it."""
    with primary.lock:
        return Follower(primary.capture_replica_state_locked(), primary.log.applied_index)


def _digest(server: InProcessServer) -> str:
    with server.lock:
        return server.digest_locked()


def _train(primary: InProcessServer, steps: range, incarnations: list[str], models: list[TinyModel], on_step=None) -> None:  # type: ignore[no-untyped-def]
    """Two workers, each step: worker 1 pulls before worker 0 pushes (rows it admits are created by
    worker 0's update), then worker 1 pushes; an eviction round every third step."""
    for seq in steps:
        prepared = []
        for w, (incarnation, model) in enumerate(zip(incarnations, models)):
            for p in model.parameters():
                p.grad = None
            model(_features(seq, w)).square().sum().backward()
            prepared.append((pack(primary.layout, [p.grad for p in model.parameters()]), model.embeddings.take_grads()))
        for w, (chunks, sparse) in enumerate(prepared):
            reply = primary.push(w, incarnations[w], seq, primary.version, chunks, 1.0, sparse)
            assert reply.status == PushStatus.APPLIED
            if on_step is not None:
                on_step()
        if seq % 3 == 2:
            primary.sparse.evict_once()


def _features(seq: int, worker: int) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    g = torch.Generator().manual_seed(1000 * worker + seq)
    offsets = torch.tensor([0, 3, 7, 9])
    # Ids drift with the step, so old rows stop being updated and the TTL evicts them.
    user = torch.randint(0, 8, (12,), generator=g) + seq // 2
    item = (torch.randint(0, 6, (12,), generator=g) + seq // 2) * (1 << 40)
    return {"user": (user, offsets), "item": (item, offsets)}


def _workers(primary: InProcessServer) -> tuple[list[str], list[TinyModel]]:
    incarnations, models = [], []
    for w in range(2):
        incarnation = primary.register(w, f"w{w}", primary.signature.to_wire()).incarnation
        model = TinyModel()
        model.embeddings.attach(_Rows(primary, incarnation) if w == 0 else _SlotRows(primary, incarnation, w))
        incarnations.append(incarnation)
        models.append(model)
    return incarnations, models


class _SlotRows(_Rows):
    def __init__(self, server: InProcessServer, incarnation: str, slot: int) -> None:
        super().__init__(server, incarnation)
        self.slot = slot

    def pull(self, request):  # type: ignore[no-untyped-def]
        return {k: v.float() for k, v in self.server.pull_rows(self.slot, self.incarnation, request).items()}


def test_a_standby_applying_the_log_holds_the_primarys_rows_bit_for_bit_at_every_version() -> None:
    primary = _primary()
    standby = _transfer(primary)
    incarnations, models = _workers(primary)
    seen: list[tuple[int, str, str]] = []

    def compare() -> None:
        standby.follow(primary)
        assert standby.server.version == primary.version
        seen.append((primary.version, _digest(primary), standby.digest()))

    _train(primary, range(24), incarnations, models, on_step=compare)
    assert [v for v, *_ in seen] == list(range(1, 49))
    assert all(ours == theirs for _, ours, theirs in seen), [v for v, ours, theirs in seen if ours != theirs]
    standby.follow(primary)  # the last eviction round came after the last update
    assert standby.digest() == _digest(primary)
    entries = [s.entry for s in primary.log.entries_from(1, 1 << 30)]
    assert any(isinstance(e, Evicted) for e in entries), "no eviction decision reached the log"
    assert any(isinstance(e, Update) and e.admitted for e in entries)
    ours, theirs = primary.sparse.stats(), standby.server.sparse.stats()
    for name, stats in ours.items():
        assert stats.evicted_total > 0 and stats.filtered_total > 0
        # The primary keeps its evictions for its next delta; a standby takes none, so keeps none.
        assert stats.tombstones_pending > 0 and theirs[name].tombstones_pending == 0
        assert (theirs[name].rows, theirs[name].evicted_total, theirs[name].admitted_total) == (
            stats.rows, stats.evicted_total, stats.admitted_total
        )


def test_a_standby_copied_in_slices_while_training_goes_on_catches_up_to_the_same_digest() -> None:
    primary = _primary()
    incarnations, models = _workers(primary)
    _train(primary, range(6), incarnations, models)
    tables = primary.sparse.begin_full()
    tables.copy_slices()  # off the server's lock: the next steps change rows the slices copied
    _train(primary, range(6, 9), incarnations, models)
    with primary.lock:
        state = primary.capture_replica_state_locked(include_sparse=False)
        closed = tables.close()
        index = primary.log.applied_index
    state["sparse"] = payloads(closed)
    standby = Follower(state, index)
    assert standby.digest() == _digest(primary)
    _train(primary, range(9, 15), incarnations, models)
    standby.follow(primary)
    assert standby.server.version == primary.version == 30
    assert standby.digest() == _digest(primary)


def test_the_digest_sees_one_changed_row() -> None:
    primary = _primary()
    incarnations, models = _workers(primary)
    _train(primary, range(3), incarnations, models)
    standby = _transfer(primary)
    assert standby.digest() == _digest(primary)
    table = standby.server.sparse.tables["user"]
    table._slab.data[table._slab.live_rows(0, 1 << 20)[0], 0] += 1e-7  # one bit of one row
    assert standby.digest() != _digest(primary)
