"""ParameterServer.push / push_named in-process: bad pushes are refused and change nothing; good ones
are applied exactly once, also under concurrency."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from harness.inprocess import assert_bit_identical, make_server, pack
from harness.procs import wait_until
from ps.api.worker_service import PROMOTION_WAIT_S
from ps.core.optim import OptimizerConfig
from ps.core.server import ParameterServer, answer
from ps.core.update_log import Sequenced
from rpcps.errors import NotPrimary, PushRejected, ServerStopping, SignatureMismatch, UnknownWorker, WorkerRemoved

SGD = OptimizerConfig(name="sgd", kwargs={"lr": 0.1})


@pytest.fixture
def server() -> ParameterServer:
    return make_server(SGD)[0]


def _register(server: ParameterServer, slot: int = 0) -> str:
    return server.register(slot, f"worker{slot}_r{slot + 1}", server.signature.to_wire()).incarnation


def _good_chunks(server: ParameterServer, seed: int = 0) -> list[torch.Tensor]:
    return pack(server.layout, [torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) for p in _params(server)])


def _params(server: ParameterServer) -> list[torch.Tensor]:
    return list(server.master_tensors().values())


def _chunk_of(server: ParameterServer, name: str) -> tuple[int, int]:
    slot = server.layout.slot(name)
    assert slot is not None
    return slot.chunk, slot.offset


def _wrong_count(s: ParameterServer) -> list[torch.Tensor]:
    return _good_chunks(s)[:-1]


def _wrong_shape(s: ParameterServer) -> list[torch.Tensor]:
    chunks = _good_chunks(s)
    chunks[1] = chunks[1][:-1].clone()
    return chunks


def _two_dim(s: ParameterServer) -> list[torch.Tensor]:
    chunks = _good_chunks(s)
    chunks[0] = chunks[0].view(1, -1)
    return chunks


def _wrong_dtype(s: ParameterServer) -> list[torch.Tensor]:
    chunks = _good_chunks(s)
    chunks[0] = chunks[0].double()
    return chunks


def _not_tensor(s: ParameterServer) -> list[torch.Tensor]:
    chunks: list = _good_chunks(s)
    chunks[0] = [1.0, 2.0]
    return chunks


def _poisoned(value: float) -> Callable[[ParameterServer], list[torch.Tensor]]:
    def make(s: ParameterServer) -> list[torch.Tensor]:
        chunks = _good_chunks(s)
        chunk, offset = _chunk_of(s, "2.bias")
        chunks[chunk][offset + 1] = value
        return chunks

    return make


BAD_CHUNKS = {
    "count": (_wrong_count, "gradient chunks, expected", "shape"),
    "shape": (_wrong_shape, "has shape [", "shape"),
    "two-dimensional": (_two_dim, "has shape [1, ", "shape"),
    "dtype": (_wrong_dtype, "has dtype torch.float64, expected torch.float32", "dtype"),
    "not-a-tensor": (_not_tensor, "chunk 0 is a list, not a tensor", "shape"),
    "nan": (_poisoned(float("nan")), "holds NaN/Inf in parameter '2.bias'; parameters unchanged", "nonfinite"),
    "inf": (_poisoned(float("-inf")), "holds NaN/Inf in parameter '2.bias'; parameters unchanged", "nonfinite"),
}


@pytest.mark.parametrize("case", BAD_CHUNKS)
def test_bad_push_is_rejected_naming_the_problem_and_changes_nothing(server: ParameterServer, case: str) -> None:
    make, message, reason = BAD_CHUNKS[case]
    incarnation = _register(server)
    server.push(0, incarnation, 0, 0, _good_chunks(server))  # a real update first: state is not pristine
    before, version = server.master_tensors(), server.version
    with pytest.raises(PushRejected) as error:
        server.push(0, incarnation, 1, version, make(server))
    assert message in str(error.value)
    assert "push 1 from worker 0" in str(error.value)
    assert_bit_identical(before, server.master_tensors())
    assert server.version == version
    assert server.stats.pushes_rejected == 1 and server.stats.updates_applied == 1
    assert server.metrics.rejected.labels(reason)._value.get() == 1
    # The server keeps serving: the next good push is applied.
    assert server.push(0, incarnation, 2, version, _good_chunks(server)).status == "applied"


def test_shape_error_names_the_parameters_in_the_chunk(server: ParameterServer) -> None:
    incarnation = _register(server)
    chunks = _good_chunks(server)
    last = len(chunks) - 1
    assert [s.spec.name for s in server.layout.slots if s.chunk == last] == ["2.bias", "4.weight", "4.bias"]
    chunks[last] = torch.zeros(5)
    with pytest.raises(PushRejected, match=rf"chunk {last} has shape \[5\], expected \[67\] \(parameters 2\.bias\.\.4\.bias\)"):
        server.push(0, incarnation, 0, 0, chunks)


def test_push_from_unregistered_slot_is_refused(server: ParameterServer) -> None:
    _register(server, 0)
    before = server.master_tensors()
    with pytest.raises(UnknownWorker, match="worker slot 3 is not registered with this server; register before pushing"):
        server.push(3, "whatever", 0, 0, _good_chunks(server))
    assert_bit_identical(before, server.master_tensors())
    assert server.version == 0 and server.metrics.rejected.labels("unknown_worker")._value.get() == 1


def test_push_from_a_replaced_incarnation_is_refused(server: ParameterServer) -> None:
    old = _register(server, 0)
    new = server.register(0, "worker0_r9", server.signature.to_wire()).incarnation
    before = server.master_tensors()
    with pytest.raises(UnknownWorker, match=r"worker slot 0 was taken over by a newer registration \(worker0_r9\)"):
        server.push(0, old, 0, 0, _good_chunks(server))
    assert_bit_identical(before, server.master_tensors())
    assert server.push(0, new, 0, 0, _good_chunks(server)).status == "applied"


def test_a_reaped_worker_is_refused_until_it_registers_again(server: ParameterServer) -> None:
    """A worker the reaper removed (silent past its lease, e.g. a cut link) must not have its pushes
    applied when its link heals: the server no longer tracks it. It rejoins instead."""
    old = _register(server, 0)
    assert server.push(0, old, 0, 0, _good_chunks(server)).status == "applied"
    server.mark_dead(0, old)
    before = server.master_tensors()
    with pytest.raises(WorkerRemoved, match="worker slot 0 .* was removed from this server; register again"):
        server.push(0, old, 1, 1, _good_chunks(server))
    with pytest.raises(WorkerRemoved):
        server.pull(0, old, 0)
    assert_bit_identical(before, server.master_tensors())
    new = _register(server, 0)
    assert server.push(0, new, 1, 1, _good_chunks(server)).status == "applied" and server.version == 2


def _follower_of(primary: ParameterServer) -> ParameterServer:
    """A second server started from ``primary``'s state transfer, as a standby is."""
    follower = make_server(SGD)[0]
    with primary.lock:
        state = primary.capture_replica_state_locked()
    follower.restore_state(state)
    return follower


@pytest.mark.parametrize("how", ["reaper", "janitor", "leave"])
def test_a_removal_goes_through_the_log_so_a_successor_refuses_the_removed_worker(server: ParameterServer, how: str) -> None:
    """The removal is a log entry: a standby that applied it (and took over) refuses the removed
    incarnation as its primary did, and counts nothing from it; the other worker goes on."""
    server.log.retain_from = 1  # as with a follower attached: the entries stay readable
    follower = _follower_of(server)
    old, other = _register(server, 0), _register(server, 1)
    assert server.push(0, old, 0, 0, _good_chunks(server)).status == "applied"
    {"reaper": lambda: server.mark_dead(0, old), "janitor": lambda: server.member_gone("worker0_r1"),
     "leave": lambda: server.leave(0, old)}[how]()
    follower.core.mirroring = True
    for sequenced in server.log.entries_from(1, 1 << 30):
        follower.log.append(Sequenced(sequenced.entry))
    with follower.lock:
        follower.apply_committed_locked()
    follower.core.mirroring = False  # it took over
    assert follower.version == 1
    with pytest.raises(WorkerRemoved, match="worker slot 0 .* was removed from this server; register again"):
        follower.push(0, old, 1, 1, _good_chunks(follower))
    assert follower.push(1, other, 0, 1, _good_chunks(follower)).status == "applied" and follower.version == 2
    assert server.metrics.workers_removed.labels({"reaper": "dead", "janitor": "gone", "leave": "left"}[how])._value.get() == 1


def test_a_state_transfer_carries_removed_registrations(server: ParameterServer) -> None:
    old = _register(server, 0)
    server.mark_dead(0, old)
    successor = _follower_of(server)
    with pytest.raises(WorkerRemoved, match="worker slot 0 .* was removed from this server"):
        successor.push(0, old, 0, 0, _good_chunks(successor))
    assert successor.push(0, _register(successor, 0), 0, 0, _good_chunks(successor)).status == "applied"


def test_a_process_that_does_not_serve_leaves_removals_to_its_primary_s_log(server: ParameterServer) -> None:
    """A standby's own reaper must not end a registration its primary still holds."""
    old = _register(server, 0)
    server.core.mirroring = True
    server.mark_dead(0, old)
    server.core.mirroring = False
    assert server.push(0, old, 0, 0, _good_chunks(server)).status == "applied"


def test_registration_outside_the_slot_range_says_which_flag_to_change() -> None:
    server = make_server(SGD, max_workers=2)[0]
    with pytest.raises(UnknownWorker, match=r"worker slot 2 is outside this server's range \[0, 2\); raise the server's --max-workers"):
        server.register(2, "w", server.signature.to_wire())


def test_registration_with_a_different_model_names_the_parameter(server: ParameterServer) -> None:
    wire = server.signature.to_wire()
    wire[2] = (wire[2][0], [99, 20], wire[2][2])
    with pytest.raises(SignatureMismatch, match=r"worker 0 \(w0\) has a different model than the server: parameter '2.weight' has shape \[99, 20\]"):
        server.register(0, "w0", wire)
    assert server.workers.records == {}


def _named(server: ParameterServer, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) for n, p in server.master_tensors().items()}


def _unknown_name(s: ParameterServer) -> dict[str, torch.Tensor]:
    grads = _named(s)
    grads["9.weight"] = torch.zeros(1)
    return grads


def _missing_name(s: ParameterServer) -> dict[str, torch.Tensor]:
    grads = _named(s)
    del grads["2.bias"]
    return grads


def _named_shape(s: ParameterServer) -> dict[str, torch.Tensor]:
    grads = _named(s)
    grads["2.weight"] = grads["2.weight"].t().contiguous()
    return grads


def _named_dtype(s: ParameterServer) -> dict[str, torch.Tensor]:
    grads = _named(s)
    grads["0.bias"] = grads["0.bias"].half()
    return grads


def _named_not_dict(s: ParameterServer) -> list[torch.Tensor]:
    return list(_named(s).values())


BAD_NAMED = {
    "unknown-name": (_unknown_name, "names parameters the model does not have: ['9.weight']", "names"),
    "missing-name": (_missing_name, "is missing gradients for ['2.bias']", "names"),
    "shape": (_named_shape, "gradient of '2.weight' has shape [20, 16], expected [16, 20]", "shape"),
    "dtype": (_named_dtype, "gradient of '0.bias' has dtype torch.float16, expected float32", "dtype"),
    "not-a-dict": (_named_not_dict, "gradients must be a dict of name -> tensor, got list", "names"),
}


@pytest.mark.parametrize("case", BAD_NAMED)
def test_bad_named_push_is_rejected_naming_the_problem_and_changes_nothing(server: ParameterServer, case: str) -> None:
    make, message, reason = BAD_NAMED[case]
    incarnation = _register(server)
    server.push_named(0, incarnation, 0, 0, _named(server))
    before, version = server.master_tensors(), server.version
    with pytest.raises(PushRejected) as error:
        server.push_named(0, incarnation, 1, version, make(server))
    assert message in str(error.value)
    assert_bit_identical(before, server.master_tensors())
    assert server.version == version and server.stats.pushes_rejected == 1
    assert server.metrics.rejected.labels(reason)._value.get() == 1


def test_named_push_applies_the_same_update_as_a_flat_push() -> None:
    flat, _ = make_server(SGD)
    named, _ = make_server(SGD)
    grads = _named(flat, seed=5)
    flat.push(0, _register(flat), 0, 0, pack(flat.layout, list(grads.values())))
    named.push_named(0, _register(named), 0, 0, grads)
    assert_bit_identical(flat.master_tensors(), named.master_tensors())


def test_named_push_from_an_unknown_worker_is_refused(server: ParameterServer) -> None:
    with pytest.raises(UnknownWorker):
        server.push_named(5, "x", 0, 0, _named(server))
    with pytest.raises(UnknownWorker):
        server.push_named(5, "x", 0, 0, _missing_name(server))


def test_nonfinite_push_is_skipped_and_counted_when_configured() -> None:
    server = make_server(SGD, on_nonfinite="skip")[0]
    incarnation = _register(server)
    before = server.master_tensors()
    reply = server.push(0, incarnation, 0, 0, _poisoned(float("nan"))(server))
    assert reply.status == "skipped" and reply.version == 0
    assert_bit_identical(before, server.master_tensors())
    assert server.stats.pushes_skipped == 1 and server.stats.pushes_rejected == 0
    assert server.metrics.skipped._value.get() == 1
    # The skipped sequence number counts as processed: a retry is not applied either.
    assert server.push(0, incarnation, 0, 0, _good_chunks(server)).status == "duplicate"
    assert server.push(0, incarnation, 1, 0, _good_chunks(server)).status == "applied"


def test_duplicate_sequence_number_is_not_applied_twice(server: ParameterServer) -> None:
    incarnation = _register(server)
    chunks = _good_chunks(server)
    assert server.push(0, incarnation, 0, 0, chunks).status == "applied"
    after_first = server.master_tensors()
    reply = server.push(0, incarnation, 0, 0, chunks)
    assert reply.status == "duplicate" and reply.version == 1
    assert_bit_identical(after_first, server.master_tensors())
    assert server.stats.pushes_duplicate == 1 and server.metrics.duplicates._value.get() == 1


def test_out_of_order_sequence_numbers_are_each_applied_once(server: ParameterServer) -> None:
    incarnation = _register(server)
    for seq in (2, 0, 1, 2, 0):
        server.push(0, incarnation, seq, 0, _good_chunks(server, seq))
    assert server.version == 3 and server.stats.pushes_duplicate == 2


def test_sequence_progress_survives_re_registration(server: ParameterServer) -> None:
    incarnation = _register(server)
    for seq in range(3):
        server.push(0, incarnation, seq, server.version, _good_chunks(server))
    registration = server.register(0, "worker0_r7", server.signature.to_wire())
    assert registration.next_step == 3
    assert server.push(0, registration.incarnation, 2, server.version, _good_chunks(server)).status == "duplicate"


def test_staleness_is_measured_and_bounded_when_configured() -> None:
    server = make_server(SGD, mode="bounded", max_staleness=1)[0]
    incarnation = _register(server)
    for seq in range(3):
        server.push(0, incarnation, seq, server.version, _good_chunks(server))
    before = server.master_tensors()
    reply = server.push(0, incarnation, 3, 0, _good_chunks(server))  # computed on version 0, now 3
    assert (reply.status, reply.staleness) == ("stale", 3)
    assert_bit_identical(before, server.master_tensors())
    assert server.push(0, incarnation, 4, 2, _good_chunks(server)).staleness == 1


def test_stopped_server_refuses_pushes_and_registrations(server: ParameterServer) -> None:
    incarnation = _register(server)
    server.stop()
    with pytest.raises(ServerStopping):
        server.push(0, incarnation, 0, 0, _good_chunks(server))
    with pytest.raises(ServerStopping):
        server.register(1, "w1", server.signature.to_wire())
    assert server.version == 0


def test_pull_returns_a_snapshot_only_when_the_version_changed(server: ParameterServer) -> None:
    incarnation = _register(server)
    first = server.pull(0, incarnation, -1)
    assert first.version == 0 and first.chunks is not None
    assert server.pull(0, incarnation, 0).chunks is None
    kept = [c.clone() for c in first.chunks]
    server.push(0, incarnation, 0, 0, _good_chunks(server))
    assert all(torch.equal(a, b) for a, b in zip(kept, first.chunks)), "a sent snapshot must not change later"
    second = server.pull(0, incarnation, 0)
    assert second.version == 1 and not torch.equal(second.chunks[0], first.chunks[0])


def test_a_push_that_asks_brings_back_what_a_pull_would(server: ParameterServer) -> None:
    incarnation = _register(server)
    reply = server.submit(0, incarnation, 0, 0, _good_chunks(server), 1.0, have_version=0).wait()
    assert reply.status == "applied" and reply.pulled is not None and reply.pulled.version == 1
    got = dict(zip(server.master_tensors(), server.layout.views(reply.pulled.chunks)))
    assert_bit_identical(got, server.master_tensors())
    assert server.pull(0, incarnation, 0).version == reply.pulled.version  # the same answer as a pull
    assert server.submit(0, incarnation, 1, 1, _good_chunks(server)).wait().pulled is None  # not asked: no parameters
    unchanged = server.submit(0, incarnation, 1, 1, _good_chunks(server), have_version=2).wait()
    assert unchanged.status == "duplicate" and unchanged.pulled is not None and unchanged.pulled.chunks is None


def test_a_push_that_asks_while_paused_hears_paused(server: ParameterServer) -> None:
    incarnation = _register(server)
    server.pause()
    reply = server.submit(0, incarnation, 0, 0, _good_chunks(server), have_version=-1).wait()
    assert reply.status == "paused" and reply.pulled is not None and reply.pulled.paused


def test_paused_server_answers_paused_without_applying(server: ParameterServer) -> None:
    incarnation = _register(server)
    server.pause()
    assert server.push(0, incarnation, 0, 0, _good_chunks(server)).status == "paused"
    assert server.version == 0
    server.resume()
    assert server.push(0, incarnation, 0, 0, _good_chunks(server)).status == "applied"


@pytest.mark.timeout(30)
def test_a_pause_behind_an_unacknowledged_push_returns_once_both_applied_at_the_version_it_holds(server: ParameterServer) -> None:
    """With a standby every entry waits for its acknowledgement: a pause sequenced behind a push
    returns only once both are applied, so the version it reports is the one it holds at (returning at
    once reported the version before that push, which then still applied)."""
    incarnation = _register(server)
    server.log.acked_index = server.log.last_index  # a standby attached: commits wait for its acknowledgement
    reply = server.submit(0, incarnation, 0, 0, _good_chunks(server), have_version=-1)
    assert server.pause(timeout_s=0.05) is False and server.version == 0  # in the log, not applied
    returned: list[bool] = []
    sequenced_before = server.log.last_index
    pausing = threading.Thread(target=lambda: returned.append(server.pause(timeout_s=10)))
    pausing.start()
    wait_until(lambda: server.log.last_index == sequenced_before + 1, 5, "the pause to be sequenced")
    assert returned == []  # waiting for the standby's acknowledgement
    server.log.acknowledged(server.log.last_index, retain=True)
    with server.lock:
        applied = server.apply_committed_locked()
    answer(applied)
    pausing.join(10)
    assert returned == [True] and server.paused and server.version == 1
    assert reply.wait().status == "applied"


@pytest.mark.timeout(30)
def test_a_push_sequenced_after_a_pause_the_standby_does_not_hold_yet_is_paused_not_applied_after_it(server: ParameterServer) -> None:
    """The state the newest pause or resume sets holds for the next push as soon as it is sequenced:
    a push that came between a pause's sequencing and its acknowledgement was applied after it, one
    version past the one the pause reported (CI: a standby at 33 while the pause said 32)."""
    incarnation = _register(server)
    server.log.acked_index = server.log.last_index  # a standby attached: commits wait for its acknowledgement
    assert server.pause(timeout_s=0.05) is False and not server.paused  # sequenced, not applied
    early = server.submit(0, incarnation, 0, 0, _good_chunks(server))
    assert early.done() and early.wait().status == "paused"
    assert server.log.last_index == server.log.applied_index + 1  # the push was not sequenced
    server.log.acknowledged(server.log.last_index, retain=True)
    with server.lock:
        answer(server.apply_committed_locked())
    assert server.paused and server.version == 0
    assert server.resume(timeout_s=0.05) is False and server.paused  # sequenced, not applied
    reply = server.submit(0, incarnation, 0, 0, _good_chunks(server))  # follows the resume: sequenced
    assert server.log.last_version == 1
    server.log.acknowledged(server.log.last_index, retain=True)
    with server.lock:
        answer(server.apply_committed_locked())
    assert reply.done() and reply.wait().status == "applied" and not server.paused and server.version == 1


@pytest.mark.timeout(60)
def test_concurrent_pushes_lose_no_update() -> None:
    """4 threads x N pushes with SGD lr=1 and constant gradients: every update lands exactly once.

    Parameters start at 0 and thread t always pushes (t + 1) / 4, so the exact final value is
    -sum over threads of N * (t + 1) / 4 (all values are exact in fp32). The pushes race, so their
    staleness varies from run to run: --staleness-lr is off to keep every step at lr 1.
    """
    threads, pushes = 4, 150
    server, _ = make_server(OptimizerConfig(name="sgd", kwargs={"lr": 1.0}), zero=True, staleness_lr=False)
    incarnations = [_register(server, t) for t in range(threads)]
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            chunks = [torch.full((n,), (t + 1) / 4) for n in server.layout.chunk_numels]
            barrier.wait(timeout=10)
            for seq in range(pushes):
                assert server.push(t, incarnations[t], seq, server.version, chunks).status == "applied"
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=30)
    assert not any(w.is_alive() for w in workers), "a pushing thread hung"
    assert not errors, errors
    assert server.version == threads * pushes == server.stats.updates_applied
    expected = -sum(pushes * (t + 1) / 4 for t in range(threads))
    for name, value in server.master_tensors().items():
        assert torch.all(value == expected), f"{name}: {value.flatten()[:3]} != {expected}"


class _Promotion:
    """A standby's promotion in progress (``ParameterServer.promotion``): its wait ends with the
    standby serving (``serves``) or not."""

    def __init__(self, server: ParameterServer, serves: bool) -> None:
        self.server, self.serves = server, serves
        self.waited: list[float] = []

    def wait(self, timeout: float) -> bool:
        self.waited.append(timeout)
        if self.serves:
            self.server.core.mirroring = False
        return True


@pytest.mark.parametrize("serves", [True, False])
def test_a_push_to_a_standby_taking_over_waits_for_it_to_serve(server: ParameterServer, serves: bool) -> None:
    """A worker that read the new view may call before the promoted standby serves: it waits for the
    promotion's outcome instead of being told to look again (and is told so only if it fails)."""
    incarnation = _register(server)
    server.core.mirroring = True
    server.core.promotion = promotion = _Promotion(server, serves)  # type: ignore[assignment]
    if serves:
        assert server.push(0, incarnation, 0, 0, _good_chunks(server)).status == "applied"
    else:
        with pytest.raises(NotPrimary):
            server.push(0, incarnation, 0, 0, _good_chunks(server))
    assert promotion.waited == [PROMOTION_WAIT_S]


def test_a_full_pull_says_which_of_the_slots_steps_its_parameters_hold(server: ParameterServer) -> None:
    """Overlapped local steps put back on top only the rounds a reply does not hold: steps 0, 1 and 3
    applied (3 ahead of 2, as a window lets it arrive), 2 not yet."""
    incarnation = _register(server)
    for seq in (0, 1, 3):
        server.push(0, incarnation, seq, server.version, _good_chunks(server, seq))
    reply = server.pull(0, incarnation, -1)
    assert (reply.applied_floor, reply.applied_above) == (1, (3,))
    assert [reply.holds_step(s) for s in range(5)] == [True, True, False, True, False]
    assert server.pull(1, _register(server, 1), -1).applied_floor == -1  # another slot: none of its steps
