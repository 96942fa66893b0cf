"""The replication log and the standby's bit-identity: two server cores in one process, one fed pushes,
the other only the entries the first sequenced, end equal (digest and tensors) at every version."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from harness.inprocess import InProcessServer, grads_like, make_server, pack
from ps.core.optim import OptimizerConfig
from ps.core.update_log import ReorderBuffer, ReplicationLog, Sequenced
from rpcps.messages import Mark, Update


def _update(index: int, version: int, slot: int = 0, seq: int = 0) -> Sequenced:
    return Sequenced(Update(index, 1, version, [torch.zeros(2)], ((slot, seq, None, 0),)))


def test_entries_commit_at_once_without_a_standby_and_wait_for_its_acknowledgement_with_one() -> None:
    log = ReplicationLog()
    log.append(_update(1, 1))
    assert log.commit_index == 1
    log.acked_index = 1  # a standby in the view: commits follow what it holds
    log.append(_update(2, 2, seq=1))
    assert log.commit_index == 1
    log.acknowledged(2, retain=True)
    assert log.commit_index == 2


@pytest.mark.parametrize("unwatched", [False, True])
def test_appends_and_applies_wake_waiters_unless_nobody_follows(unwatched: bool) -> None:
    log = ReplicationLog()
    log.unwatched = unwatched
    woken: list[bool] = []
    log.cond.notify_all = lambda: woken.append(True)  # type: ignore[method-assign]
    first = _update(1, 1)
    log.append(first)
    log.applied(first)
    assert woken == ([] if unwatched else [True, True])
    log.acknowledged(1, retain=False)  # a follower's acknowledgement always wakes the sender and applier
    assert woken[-1:] == [True]


def test_entries_apply_in_index_order_and_are_freed_once_nobody_needs_them() -> None:
    log = ReplicationLog()
    released: list[int] = []
    for i in (1, 2, 3):
        s = _update(i, i, seq=i)
        s.on_release = lambda i=i: released.append(i)
        log.append(s)
    log.retain_from = 1  # a follower has acknowledged nothing yet
    for expected in (1, 2):
        nxt = log.next_to_apply()
        assert nxt is not None and nxt.index == expected
        log.applied(nxt)
    assert released == [] and [s.index for s in log.entries_from(1, 1 << 30)] == [1, 2, 3]
    log.acknowledged(1, retain=False)
    assert released == [1]
    assert [s.index for s in log.unapplied()] == [3]
    with pytest.raises(LookupError):
        log.entries_from(1, 1 << 30)


def test_a_retry_of_a_sequenced_push_is_pending_until_applied() -> None:
    log = ReplicationLog()
    s = _update(1, 1, slot=3, seq=9)
    log.append(s)
    assert log.pending[(3, 9)] is s
    log.applied(s)
    assert (3, 9) not in log.pending


def test_entries_must_follow_each_other() -> None:
    log = ReplicationLog(applied_index=5, version=7)
    with pytest.raises(ValueError, match="does not follow 5"):
        log.append(_update(7, 8))


def test_the_reorder_buffer_hands_entries_on_in_index_order_once() -> None:
    buffer = ReorderBuffer(have_through=10)
    marks = {i: Mark(i, 1, 0, i) for i in range(9, 15)}
    assert buffer.add([marks[12], marks[13]]) == []
    assert buffer.add([marks[11]]) == [marks[11], marks[12], marks[13]]
    assert buffer.add([marks[9], marks[12], marks[14]]) == [marks[14]]  # old and repeated ones are dropped
    assert buffer.have_through == 14 and buffer.waiting == 0


# ---- bit-identity -------------------------------------------------------------------------------


class Pair:
    """A primary fed pushes and a standby fed only the primary's log entries."""

    def __init__(self, optimizer: OptimizerConfig, **core: object) -> None:
        self.primary, self.model = make_server(optimizer, **core)
        self.standby, _ = make_server(optimizer, **core)
        self.standby.core.mirroring = True
        self.primary.core.log.retain_from = 1  # keep every entry for the standby
        self.shipped = 0
        self.compared = 0

    def ship(self) -> None:
        """Hands the standby every entry sequenced since the last call, applies them, compares digests."""
        entries = self.primary.core.log.entries_from(self.shipped + 1, 1 << 40) if self.primary.core.log.last_index > self.shipped else []
        for sequenced in entries:
            core = self.standby.core
            with core.lock:
                core.log.append(Sequenced(sequenced.entry))
                core.apply_committed_locked()
            self.shipped = sequenced.index
            self.primary.core.log.acknowledged(sequenced.index, retain=False)
            if isinstance(sequenced.entry, Update):
                self.compared += 1
        assert self.standby.core.version == self.primary.core.version
        with self.primary.core.lock, self.standby.core.lock:
            assert self.primary.core.digest_locked() == self.standby.core.digest_locked()


def _register(server: InProcessServer, slot: int) -> str:
    return server.register(slot, f"worker{slot}_r{slot}", server.signature.to_wire()).incarnation


CASES: dict[str, Callable[[], Pair]] = {
    "adam": lambda: Pair(OptimizerConfig(name="adam", kwargs={"lr": 0.01})),
    "sgd-momentum-schedule": lambda: Pair(
        OptimizerConfig(name="sgd", kwargs={"lr": 0.1, "momentum": 0.9}, schedule="cosine", schedule_kwargs={"T_max": 50})
    ),
    "adam-bf16-wire": lambda: Pair(OptimizerConfig(name="adam", kwargs={"lr": 0.01}), wire_dtype="bf16"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_standby_fed_the_log_is_bit_identical_at_every_version(case: str) -> None:
    pair = CASES[case]()
    p = pair.primary
    incarnations = [_register(p, slot) for slot in (0, 1)]
    pair.ship()
    wire = p.core.wire
    for step in range(12):
        for slot in (0, 1):
            chunks = pack(p.layout, grads_like(pair.model, seed=100 * slot + step, scale=0.1))
            if step % 4 == 3:  # top-k: (indices, values) pairs, widened by both replicas the same way
                sent = [(idx := torch.randperm(c.numel(), generator=torch.Generator().manual_seed(step))[: c.numel() // 3],
                         c[idx].to(wire)) for c in chunks]
            else:
                sent = [c.to(wire) for c in chunks]
            p.push(slot, incarnations[slot], step, p.version, sent, loss=1.0)
        if step == 5:  # refused and skipped steps are recorded through the log too
            bad = pack(p.layout, grads_like(pair.model, seed=7))
            bad[0][0] = float("nan")
            with pytest.raises(Exception, match="NaN"):
                p.push(0, incarnations[0], 100, p.version, [c.to(wire) for c in bad])
            p.pause()
            p.resume()
        pair.ship()
    assert pair.compared == 24
    s = pair.standby
    assert s.core.workers.records[0].tracker.seen(100), "the refused step is recorded as processed on the standby too"
    assert {slot: r.incarnation for slot, r in s.core.workers.records.items()} == dict(enumerate(incarnations))
    with torch.no_grad():
        for name, value in p.master_tensors().items():
            assert torch.equal(value, s.master_tensors()[name]), name


def test_a_sync_round_ships_its_mean_and_the_standby_steps_with_it() -> None:
    pair = Pair(OptimizerConfig(name="adam", kwargs={"lr": 0.01}), mode="sync", min_workers=2)
    p = pair.primary
    incarnations = [_register(p, slot) for slot in (0, 1)]
    for step in range(5):
        futures = [
            p.submit(slot, incarnations[slot], step, p.version, pack(p.layout, grads_like(pair.model, 10 * step + slot)), 1.0)
            for slot in (0, 1)
        ]
        assert [f.wait().status for f in futures] == ["applied", "applied"]
        pair.ship()
    assert pair.compared == 5 and p.version == 5


def test_async_replication_commits_up_to_max_lag_entries_ahead_of_the_standby() -> None:
    """The lag bound: the primary applies (and answers) at most ``max_lag`` entries the standby lacks;
    the next push waits, sequenced but not committed, until the standby acknowledges more."""
    log = ReplicationLog()
    log.acked_index, log.max_lag = 0, 3  # an in-sync standby that holds nothing yet
    for i in range(1, 6):
        log.append(_update(i, i, seq=i))
    assert log.commit_index == 3  # entries 4 and 5 wait for the standby
    while (nxt := log.next_to_apply()) is not None:
        log.applied(nxt)
    assert log.applied_index == 3 and log.unreplicated == 3  # what a failover now would lose: never above max_lag
    log.acknowledged(2, retain=True)
    assert log.commit_index == 5 and log.unreplicated == 1
    log.acked_index = None  # the standby was dropped: nothing waits for it
    assert log.commit_index == 5 and log.unreplicated == 0


def test_sync_replication_has_no_unreplicated_entries() -> None:
    log = ReplicationLog()
    log.acked_index = 0
    log.append(_update(1, 1))
    assert log.next_to_apply() is None and log.unreplicated == 0
