"""The worker's training loop: compute on local data, push gradients asynchronously, pull parameters.

Pushes are fire-and-forget within a bounded window: step t+1 computes while step t's gradient is on
the wire. A window slot (and its gradient buffers) is reused only after its reply arrives, so a
buffer is never overwritten while TensorPipe may still be reading it.

Parameters come back with the push replies (``--prefetch-pull on``, the default): a push asks for
them when a refresh is due within the window, and the next refresh loads the newest that arrived, so
a step costs one call, not a push and a pull. Step t computes on parameters at least as fresh as
the reply to push t - window brings: with the default window of 1, the parameters push t - 1 made
(nothing a lone worker computes on is stale; issue 27); with a window of 2, what a pull issued when
step t - 1 started would have answered, so the newest push stays on the wire while step t computes. Only when
no such reply came (the first step, a paused server, a refused push) does a refresh pull on its own.

With several server shards each step sends one push per shard (its own parameters' gradients), in
parallel, and pulls from every shard. A push a shard refuses as too stale ('bounded' and 'sync'
modes) is recomputed on that shard's fresh parameters from the same batch, with the same step
number, and sent to that shard alone. In 'sync' mode the window is one step: the reply arrives when
the round closes, and the next step computes on the round's result.

A shard whose view names a standby survives the loss of its primary without this process
restarting: a call that finds the primary gone (or answers ``NotPrimary``) makes the worker wait for
the shard's next view (the standby promotes itself), switch to the new primary and send it again
every push of that shard still in the window, in step order. Its buffers are still owned by the
window, and the new primary deduplicates by (slot, step), so a push the old primary committed is
answered 'duplicate' and nothing is applied twice. With asynchronous replication the new primary
may lack up to ``--max-replica-lag`` of the newest acknowledged updates: the worker recomputes its
own among them (``worker.acked``) and reloads the parameters. Registrations are replicated, so the slot keeps
its incarnation. Without a standby the worker restarts itself to rejoin, as before. A primary that
is frozen rather than dead never answers; the new primary announces itself (``view_changed``), and a
worker waiting on the old one gives up on it then.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rpcps import failpoints, plugins, threads, transport
from rpcps.errors import CheckpointFailed, NotPrimary, PushRejected, ServerStarting
from rpcps.logsafe import MESSAGE_LIMIT, peer_text
from rpcps.messages import FinishReply, Mode, PullReply, PushReply, PushStatus, Registration, View
from rpcps.partition import partition, partition_digest
from rpcps.signature import FlatLayout, ModelSignature
from rpcps.sparse.embedding import collections_of
from rpcps.sparse.spec import SparsePull, SparsePush, declared_tables
from rpcps.summary import run_summary
from rpcps.wire import TopK, wire_dtype
from worker.acked import AckedPushes
from worker.buffers import ModelBuffers
from worker.client import ServerClient, ShardUnavailable, result, shard_view
from worker.config import DEFAULT_LOCAL_STEPS, WorkerConfig
from worker.device import GradientStager, ParameterSink, memory_in_use, pick_device
from worker.local_steps import RoundStart
from worker.metrics import WorkerMetrics
from worker.sparse_client import SparseRouter
from worker.step import Step, StepEnded

logger = logging.getLogger(__name__)

_LOSS_WINDOW = 10
"""Losses averaged for a summary's initial_loss (the first ones) and final_loss (the latest ones)."""

_NOT_SERVING = (NotPrimary, ServerStarting)
"""What the primary the view names answers while it does not serve: it holds no lease yet, or it has
withdrawn its API (stepping down, about to restart: CI saw a worker exit 1 on ServerStarting from a
lone primary fenced by its etcd claim)."""
_PRIMARY_LOST = (transport.PeerUnreachable, *_NOT_SERVING)
"""What a call to a shard's primary raises when that process is gone or no longer serves the shard."""
_MOVED_POLL_S = 0.05
"""How often a worker waiting for a reply checks whether the shard's primary was replaced meanwhile."""
_LEASE_RETRY_S = 0.1
"""How often a worker calls again a primary that answered it holds no lease yet."""


class TooManyRejects(RuntimeError):
    pass


class ServerBehind(RuntimeError):
    """A shard holds fewer of this slot's steps than the worker computed (it resumed from an older
    checkpoint in the meantime): rejoin and recompute from where the server is."""


class NotDurable(RuntimeError):
    """The server could not commit a snapshot holding this slot's last steps (it kept failing)."""


class DataExhausted(ValueError):
    """The ``--data`` iterable ended before ``--steps``: every step needs a batch of its own.

    A ValueError, so the command line reports it as a bad setting (one line, exit 2) instead of the
    bare ``StopIteration`` that ``next()`` raises, which names neither the data nor the step."""


def open_data(data: Iterable[Any], start: int) -> Iterator[Any]:
    """``data``'s items from position ``start`` on: its ``seek`` when it has one, else read and discard."""
    if hasattr(data, "seek"):
        data.seek(start)
        return iter(data)
    # No seek: skip to the recorded position by reading (and discarding) what came before.
    return itertools.islice(iter(data), start, None)


def open_batches(config: WorkerConfig, start: int) -> Iterator[plugins.Batch]:
    """The slot's batches from step ``start`` on (``--data``'s ``seek`` when it has one)."""
    return open_data(plugins.load_data(config.data, config.worker_index, config.num_workers), start)


def next_batch(batches: Iterator[Any], step: int, config: WorkerConfig, source: str | None = None) -> Any:
    """The batch of step ``step``; ``source`` names the data in the error (default: ``--data``).

    Raises:
        DataExhausted: ``batches`` ended.
    """
    try:
        return next(batches)
    except StopIteration:
        what = source or f"--data {config.data!r}"
        raise DataExhausted(
            f"{what} (slot {config.worker_index} of {config.num_workers}) ended before step {step} of "
            f"--steps {config.steps}: a data factory must return an endless iterable, or one with a batch for every step"
        ) from None


@dataclass
class _InFlight:
    """One push: a step's gradients for one shard."""

    seq: int
    shard: int
    base_version: int
    buffers: list[torch.Tensor]
    loss: float | None
    batch: Any
    """Kept so a push refused as stale can be recomputed from the same data."""
    payload: list[Any] | None = None
    """What goes on the wire: the buffers themselves, or their top-k (indices, values)."""
    sparse: SparsePush | None = None
    """This shard's sparse rows of the step (models with sparse tables only)."""
    absent: int = 0
    """The presence mask: bit i set when this shard's parameter i got no gradient (``ps.core.presence``)."""
    future: Any = None
    sent: float = 0.0
    attempts: int = 1


@dataclass
class _OpenStep:
    """The trainer's bookkeeping of a step handed out and not ended yet (``Step._state``)."""

    shards: list[ShardLink]
    bound: dict[int, list[torch.Tensor]]
    """Per shard index, the window buffers its parameters' ``.grad`` are views of (direct staging)."""
    started: float
    blocked: float


def _samples(batch: Any, accumulate: int) -> int:
    """Examples in a step's batch, for the samples counter: the leading size of its first tensor."""
    first: Any = batch
    for _ in range(4):
        if isinstance(first, torch.Tensor):
            return (first.shape[0] if first.dim() else 1) * accumulate
        if isinstance(first, dict):
            first = next(iter(first.values()), None)
        elif isinstance(first, (list, tuple)):
            first = first[0] if first else None
        else:
            return 0
    return 0


@dataclass
class ShardLink:
    """What the worker keeps per server shard."""

    index: int
    client: ServerClient
    registration: Registration
    layout: FlatLayout
    params: list[torch.nn.Parameter]
    stager: GradientStager
    sink: ParameterSink
    free: list[list[torch.Tensor]]
    topk: TopK | None = None
    version: int = -1
    pending: PullReply | None = None
    """The newest parameters a push reply brought that are not loaded yet."""
    fresh_as_of: int = -1
    """The newest parameters received (loaded or pending) are the server's as of this step: the
    reply to push t brings them as of step t + 1, a pull made for step t as of step t."""
    last_reply: float = 0.0
    """time.monotonic() of the latest push reply (the server saw us then: no heartbeat needed)."""
    unleased_since: float | None = None
    """time.monotonic() of the first of the window's pushes that the primary the view still names
    answered ``NotPrimary`` or ``ServerStarting`` (None since a push was answered): the worker asks
    it again until ``failover_timeout_s`` has passed since."""

    @property
    def all_absent(self) -> int:
        """The presence mask of a push that moves none of this shard's parameters (a skipped step)."""
        return (1 << len(self.params)) - 1


@dataclass
class WorkerStats:
    """What this worker slot's summary reports, across every incarnation of its process.

    A worker that restarts itself in place (``os.execv`` after losing its server) hands these on
    with ``to_carry``, so its summary describes the slot's whole job, not its last incarnation.
    """

    first_losses: list[float] = field(default_factory=list)
    recent_losses: deque[float] = field(default_factory=lambda: deque(maxlen=_LOSS_WINDOW))
    steps: int = 0
    applied: int = 0
    rejected: int = 0
    staleness_sum: int = 0
    started: float = field(default_factory=time.monotonic)
    """time.monotonic() when the first incarnation started (the clock is system-wide, so it survives execv)."""

    def note_loss(self, loss: float) -> None:
        if len(self.first_losses) < _LOSS_WINDOW:
            self.first_losses.append(loss)
        self.recent_losses.append(loss)

    def to_carry(self) -> str:
        return json.dumps({**asdict(self), "recent_losses": list(self.recent_losses)})

    @classmethod
    def from_carry(cls, text: str | None) -> WorkerStats:
        if not text:
            return cls()
        fields = json.loads(text)
        return cls(**{**fields, "recent_losses": deque(fields["recent_losses"], maxlen=_LOSS_WINDOW)})

    def summary(self, next_step: int, reconnects: int) -> dict[str, Any]:
        head, tail = self.first_losses, self.recent_losses
        return run_summary(
            "worker",
            initial_loss=sum(head) / len(head) if head else None,
            final_loss=sum(tail) / len(tail) if tail else None,
            steps=self.steps,
            updates_applied=self.applied,
            pushes_rejected=self.rejected,
            staleness_sum=self.staleness_sum,
            wall_seconds=time.monotonic() - self.started,
            next_step=next_step,
            reconnects=reconnects,
        )


class Trainer:
    def __init__(
        self,
        config: WorkerConfig,
        clients: list[ServerClient],
        rpc_name: str,
        metrics: WorkerMetrics,
        stats: WorkerStats | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        """Registers ``model`` (``--model``'s when None; moved to ``--device``) with every shard."""
        self.config = config
        self.metrics = metrics
        self.device = pick_device(config.device)
        self.model = (model if model is not None else plugins.load_model(config.model)).to(self.device)
        self.signature = ModelSignature.of_module(self.model)
        self.model_buffers = ModelBuffers(self.model, self.signature)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.params = params
        registrations = [c.register(config.worker_index, rpc_name, self.signature.to_wire()) for c in clients]
        first = registrations[0]
        if first.shard_count != len(clients) or any(r.shard_index != i for i, r in enumerate(registrations)):
            raise RuntimeError(f"the servers report {first.shard_count} shards but this worker reached {len(clients)}")
        if first.partition_digest != partition_digest(self.signature, first.shard_count):
            raise RuntimeError("the servers partition the model differently from this worker; same rpcps version on both?")
        self.mode = first.mode
        self.local_steps: int | None = None
        """H, the micro-batches (inner steps) of each step in local-steps mode; None in the gradient modes."""
        self._round: RoundStart | None = None
        if self.mode == Mode.LOCAL_STEPS:
            self.local_steps = config.local_steps or DEFAULT_LOCAL_STEPS
            self._round = RoundStart(params)
        elif config.local_steps is not None:
            raise ValueError(f"--local-steps needs a server in --mode local-steps; this one runs --mode {self.mode}")
        owned = partition(self.signature, first.shard_count)
        self.shards: list[ShardLink] = []
        # A round starts from the parameters its own delta produced (DiLoCo): one push on the wire;
        # with overlapped rounds, from those of the round before, its own last round kept on top.
        if self.mode == Mode.LOCAL_STEPS:
            # Top-k's error feedback keeps progress off the wire that a fold could not put back.
            overlap = config.overlap_rounds and config.topk_ratio is None
            if config.overlap_rounds and not overlap:
                logger.info("rounds are not overlapped with --topk-ratio: each round waits for the last one's reply")
            window = 2 if overlap else 1
        else:
            window = 1 if self.mode == Mode.SYNC else config.max_in_flight
        self._overlapped_rounds = self.mode == Mode.LOCAL_STEPS and window > 1
        for client, reg, indices in zip(clients, registrations, owned):
            layout = FlatLayout(ModelSignature(tuple(self.signature.params[i] for i in indices)), reg.chunk_bytes)
            if layout.chunk_numels != tuple(reg.chunk_numels):
                raise RuntimeError(f"shard {reg.shard_index} packs parameters differently from this worker")
            shard_params = [params[i] for i in indices]
            wire = wire_dtype(reg.wire_dtype)
            # Top-k picks from fp32 gradients (its residual is fp32); its values are cast when sent.
            stager = GradientStager(layout, shard_params, self.device, torch.float32 if config.topk_ratio else wire)
            free = [stager.new_buffers() for _ in range(window)]
            topk = TopK(layout.chunk_numels, config.topk_ratio, wire) if config.topk_ratio else None
            sink = ParameterSink(layout, shard_params, wire)
            self.shards.append(ShardLink(reg.shard_index, client, reg, layout, shard_params, stager, sink, free, topk))
        self.sparse_modules = collections_of(self.model)
        self.router: SparseRouter | None = None
        if self.sparse_modules:
            self.metrics.watch_sparse()
            self.router = SparseRouter(declared_tables(self.model), first.shard_count, wire_dtype(first.wire_dtype), self._pull_rows)
            for module in self.sparse_modules:
                module.attach(self.router)
        # A shard restored from an older snapshot has processed fewer steps: start at the earliest;
        # shards that already have a step answer 'duplicate'.
        self.step = min(r.next_step for r in registrations)
        self.pull_every = 1 if self.mode in (Mode.SYNC, Mode.LOCAL_STEPS) else config.pull_every
        self.window = window
        self.pull_with_push = config.prefetch_pull
        self.stats = stats or WorkerStats()
        self._in_flight: deque[_InFlight] = deque()
        self._redo: deque[_InFlight] = deque()
        # A shard that may lose acknowledged updates on a failover (asynchronous replication) can
        # lose at most its lag bound of them: keep that many batches (plus the window) to recompute.
        self._acked: AckedPushes[tuple[torch.Tensor, torch.Tensor]] = AckedPushes(
            [link.client.max_lag + window if link.client.max_lag else 0 for link in self.shards]
        )
        self._rejects_in_a_row = 0
        self._stop = threading.Event()
        self.current: Step | None = None
        """The step handed out and not ended yet."""
        self._moved: set[int] = set()
        self._hints_ignored: set[tuple[int, int]] = set()
        """Shards whose new primary announced itself (``view_changed``) while this worker used an older one."""
        logger.info(
            "slot %d registered with %d shard(s), mode %s, on %s; %d parameters; resuming at step %d of %d",
            config.worker_index, len(self.shards), self.mode, self.device, self.signature.numel, self.step, config.steps,
        )

    def view_changed(self, shard: int, view: View) -> None:
        """A shard's new primary announced itself (runs on an RPC thread: only records it)."""
        if 0 <= shard < len(self.shards) and view.epoch > self.shards[shard].client.view.epoch:
            self._moved.add(shard)

    @property
    def slot(self) -> int:
        return self.config.worker_index

    @property
    def registration(self) -> Registration:
        return self.shards[0].registration

    def steps(self, data: Iterable[Any], accumulate: int = 1, source: str | None = None) -> Generator[Step, None, None]:
        """The slot's steps from where the servers resumed it, each to be ended by ``push`` or ``skip``.

        ``data`` is positioned at the resumed step (``accumulate`` items per step); parameters are
        refreshed only between steps. A push refused as stale, or an acknowledged step lost with a
        failed primary, comes back as a replay (same index and batch). After the last step the
        window is drained, and steps that must be computed again meanwhile are handed out too.
        ``source`` names the data in errors.
        """
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        heartbeat.start()
        try:
            batches = open_data(data, self.step * accumulate)
            first = True
            while not self._stop.is_set():
                step_started = time.perf_counter()
                if self._redo:
                    yield from self._replay(self._redo.popleft(), step_started, accumulate)
                    continue
                if self.step >= self.config.steps:
                    if not self._in_flight:
                        break
                    self._complete_oldest()
                    continue
                comm = 0.0
                if first or self.step % self.pull_every == 0:
                    # Pushed parameters may lag by the window (the newest push is still on the wire).
                    comm += self._refresh(self.shards, self.step - self.window + 1 if self.pull_with_push else self.step)
                    first = False
                    if self._stop.is_set():
                        break
                if accumulate == 1:
                    batch = next_batch(batches, self.step, self.config, source)
                else:
                    batch = [next_batch(batches, self.step, self.config, source) for _ in range(accumulate)]
                yield from self._offer(self._open_step(self.step, batch, self.shards, False, accumulate, step_started, comm))
                self.step += 1
            while self._in_flight or self._redo:  # drain: every push answered, every refused one recomputed
                if self._in_flight:
                    self._complete_oldest()
                else:
                    yield from self._replay(self._redo.popleft(), time.perf_counter(), accumulate)
        finally:
            self._stop.set()

    def summary(self) -> dict[str, Any]:
        return self.stats.summary(self.step, 0)

    def _replay(self, item: _InFlight, started: float, accumulate: int) -> Iterator[Step]:
        """A step computed again for one shard (refused as stale, or lost), on that shard's newest parameters."""
        link = self.shards[item.shard]
        self.metrics.replays.inc()
        comm = self._refresh([link], None)
        yield from self._offer(self._open_step(item.seq, item.batch, [link], True, accumulate, started, comm))

    def _offer(self, step: Step) -> Iterator[Step]:
        self.current = step
        yield step
        self.current = None
        if step.ended is None:
            raise StepEnded(f"step {step.index} was neither pushed nor skipped: end every step with push() or skip()")

    def stop(self) -> None:
        self._stop.set()

    @property
    def completed(self) -> bool:
        """Every step of this slot was computed and acknowledged (not stopped early)."""
        return self.step >= self.config.steps and not self._in_flight and not self._redo

    def finish(self, *, checkpoints_off_ok: bool = False) -> bool:
        """Asks every shard to make this slot's steps durable; returns once they are.

        Returns False when a shard checkpoints nothing (then a server crash would lose them): a
        warning, or an INFO line with ``checkpoints_off_ok`` (the launcher said so already).
        Raises ServerBehind when a shard holds fewer steps than computed here, and NotDurable when a
        shard kept failing to commit a snapshot.
        """
        durable = True
        for link in self.shards:
            reply = self._finish_on(link)
            if not reply.complete:
                raise ServerBehind(f"shard {link.index} holds this slot's steps up to {reply.next_step}, not {self.step}")
            if reply.durable:
                logger.info("shard %d: all %d steps durable in its checkpoint of version %d", link.index, self.step,
                            reply.checkpoint_version)
            else:
                durable = False
                logger.log(logging.INFO if checkpoints_off_ok else logging.WARNING,
                           "shard %d checkpoints nothing (no --checkpoint-dir): a server crash would lose these steps", link.index)
        return durable

    def _finish_on(self, link: ShardLink) -> FinishReply:
        for attempt in range(self.config.max_retries + 1):
            try:
                return self._with_retries(
                    lambda: self._at_primary(link, lambda: link.client.finish(self.slot, link.registration.incarnation, self.step))
                )
            except CheckpointFailed as e:
                if attempt == self.config.max_retries:
                    raise NotDurable(str(e)) from e
                backoff = min(0.5 * 2**attempt, 5.0)
                logger.warning("%s; asking again in %.1fs", peer_text(str(e), MESSAGE_LIMIT), backoff)
                time.sleep(backoff)
        raise AssertionError("unreachable")

    # ---- helpers -------------------------------------------------------------------------------

    def _open_step(
        self, seq: int, batch: Any, shards: list[ShardLink], replay: bool, accumulate: int, started: float, blocked: float
    ) -> Step:
        """A step about to be computed: gradients cleared and, where backward can write straight into
        the wire buffers, a window slot taken and bound. ``blocked`` is what the step already spent
        blocked (its pull), counted as communication, not compute."""
        threads.sync()  # the host's budget may have changed since the last step (rpcps.threads)
        for p in self.params:
            p.grad = None
        for module in self.sparse_modules:
            module.drop_grads()  # rows of forwards made between steps are no part of this one
        bound: dict[int, list[torch.Tensor]] = {}
        if self._round is not None:
            self._round.begin()
        for link in shards:
            # Local steps push a delta, not what backward leaves: nothing is bound to the wire buffers.
            if link.stager.direct and self._round is None:
                # The window slot is taken before the forward pass, and backward writes into it. With
                # prefetched parameters this waits for nothing: the refresh that started the step
                # already waited for the reply that frees it.
                blocked += self._wait_for_free_slot(link)
                bound[link.index] = link.free.pop()
                link.stager.bind(bound[link.index])
        return Step(seq, batch, replay, accumulate, self, _OpenStep(shards, bound, started, blocked))

    def push_step(self, step: Step, loss: float | None) -> None:
        """One push per shard of ``step`` from the gradients its backward(s) left (``Step.push``)."""
        state: _OpenStep = step._state
        comm = state.blocked
        sparse = self._sparse_parts()
        if self._round is not None:
            self._round.deltas_as_grads()
        for link in state.shards:
            buffers = state.bound.get(link.index)
            if buffers is None:
                comm += self._wait_for_free_slot(link)
                buffers = link.free.pop()
                absent = link.stager.stage(buffers)
                link.stager.wait()
            else:
                absent = link.stager.absent_bound(buffers)
            if link.topk is not None:
                # Error feedback carries earlier steps' gradient of every parameter: none is absent.
                absent = 0
            payload = link.topk.compress(buffers) if link.topk is not None else buffers
            if link.index == 0 and self.model_buffers:  # shard 0 holds the model's buffers
                payload = [*payload, *self.model_buffers.for_push()]
            part = None if sparse is None else sparse[link.index]
            self._send(_InFlight(step.index, link.index, link.version, buffers, loss, step.batch, payload, sparse=part, absent=absent))
        failpoints.hit("worker.after_push")
        self._end_step(step, comm, loss)

    def skip_step(self, step: Step) -> None:
        """Records ``step`` as processed with nothing applied (``Step.skip``): a push whose presence
        mask names every parameter, which the server records without an update (``ps.core.presence``)."""
        state: _OpenStep = step._state
        comm = state.blocked
        for module in self.sparse_modules:
            module.drop_grads()  # a skipped step moves no row either
        for link in state.shards:
            buffers = state.bound.get(link.index)
            if buffers is None:
                comm += self._wait_for_free_slot(link)
                buffers = link.free.pop()
            wire = wire_dtype(link.registration.wire_dtype)
            payload: list[Any] = [torch.zeros(n, dtype=wire) for n in link.layout.chunk_numels]
            if link.index == 0 and self.model_buffers:
                payload += self.model_buffers.for_push()
            absent = link.all_absent
            self._send(_InFlight(step.index, link.index, link.version, buffers, None, step.batch, payload, absent=absent))
        self.metrics.steps_skipped.inc()
        self._end_step(step, comm, None)

    def zero_grad_step(self, step: Step) -> None:
        """Clears what the step's backward(s) accumulated so far (``Step.zero_grad``)."""
        state: _OpenStep = step._state
        for p in self.params:
            p.grad = None
        for module in self.sparse_modules:
            module.drop_grads()
        for link in state.shards:
            buffers = state.bound.get(link.index)
            if buffers is not None:
                link.stager.bind(buffers)

    def between_micro_batches(self, step: Step) -> None:
        """Overlapped local steps: the last round's reply, once it is here, is folded in between two
        inner steps rather than at the next round (which would compute a whole round on parameters
        that miss the other workers' last deltas); the round's own progress stays on top."""
        if not self._overlapped_rounds or step.replay or self._round is None or step is not self.current or step.ended:
            return  # after push() the round's start holds its delta: nothing to fold into
        while self._in_flight and self._in_flight[0].future.done():
            self._complete_oldest()
        state: _OpenStep = step._state
        for link in state.shards:
            pending = link.pending
            # A gradient not yet stepped on was computed on the parameters as they are: fold later.
            if pending is None or any(p.grad is not None for p in link.params):
                continue
            link.pending = None
            self._round.rebase(link.params, functools.partial(self._take_reply, link, pending))

    def _take_reply(self, link: ShardLink, reply: PullReply) -> None:
        """Loads the parameters of a pull or a push reply (overlapped local steps: with this worker's
        rounds still on the wire on top)."""
        self._load(link, reply)
        if self._overlapped_rounds:
            self._keep_unanswered_rounds(link, reply)

    def _end_step(self, step: Step, comm: float, loss: float | None) -> None:
        # The buffers belong to the window now: a caller's zero_grad must not reach them.
        for p in self.params:
            p.grad = None
        if self.mode == Mode.SYNC:
            comm += self._drain_timed()
        if step.replay:
            self.metrics.step_seconds.observe(time.perf_counter() - step._state.started)
        else:
            self._account(step._state.started, comm, loss, _samples(step.batch, step.accumulate))

    def _sparse_parts(self) -> list[SparsePush] | None:
        """Per shard, the sparse tables' summed gradients of this step (None without sparse tables)."""
        if self.router is None:
            return None
        grads: SparsePush = {}
        for module in self.sparse_modules:
            grads.update(module.take_grads())
            looked_up, distinct = module.take_lookup_counts()
            self.metrics.sparse_ids.inc(looked_up)
            self.metrics.sparse_unique_ids.inc(distinct)
        return self.router.split_push(grads)

    def _refresh(self, shards: list[ShardLink], as_of: int | None) -> float:
        """Loads parameters at least as fresh as the server's at step ``as_of`` into ``shards``;
        waits while paused. Returns blocked time.

        What push replies brought serves when it is fresh enough (waiting for the replies of
        pushes in flight to that shard if needed); the other shards are pulled, in parallel.
        ``as_of=None`` pulls every shard (a push refused as stale is recomputed on the newest).
        """
        started = time.perf_counter()
        if as_of is None:
            as_of = self.step + 1  # newer than anything received: pull
        else:
            as_of = max(as_of, 0)  # the first step always starts from a pull
            if self.pull_with_push:
                self._await_pushed_params(shards, as_of)
        stale = [link for link in shards if link.fresh_as_of < as_of]
        for link in shards:
            if link.fresh_as_of >= as_of and link.pending is not None:
                self._take_reply(link, link.pending)
            link.pending = None
        while stale:
            replies = self._with_retries(lambda: self._pull_all(stale))
            paused = False
            for link, reply in zip(stale, replies):
                self._note_stop(reply)
                if reply.chunks is not None:
                    self._take_reply(link, reply)
                link.fresh_as_of = max(link.fresh_as_of, self.step)  # pulled now
                paused = paused or reply.paused
            if not paused or self._stop.is_set():
                break
            self._stop.wait(self.config.pause_poll_s)
        self.metrics.model_version.set(sum(s.version for s in self.shards))
        elapsed = time.perf_counter() - started
        self.metrics.pull_seconds.observe(elapsed)
        return elapsed

    def _await_pushed_params(self, shards: list[ShardLink], as_of: int) -> None:
        """Takes the replies that already arrived, then, for each shard whose parameters are older
        than step ``as_of``, waits for its pushes in flight, oldest first, until one brings newer."""
        while self._in_flight and self._in_flight[0].future.done():
            self._complete_oldest()
        for link in shards:
            while not self._stop.is_set() and link.fresh_as_of < as_of and self._unanswered(link):
                self._complete_oldest()

    def _keep_unanswered_rounds(self, link: ShardLink, reply: PullReply) -> None:
        """Overlapped local steps: the parameters just loaded are the server's after some rounds of
        this worker; its rounds still on the wire that they do not hold (the reply says which it
        holds) are this worker's progress since, put back on top (each pushed delta is ``start -
        end``, so the parameters become the server's minus them: Kale et al. 2025's eager update,
        each worker's own delta standing in for its share of the outer steps to come). A skipped
        round sent no delta (its buffers hold nothing of it): its progress is dropped, as the next
        reply drops it without overlap."""
        skipped = link.all_absent
        for item in self._in_flight:
            if item.shard == link.index and item.absent != skipped and not reply.holds_step(item.seq):
                link.sink.subtract(item.buffers)

    def _unanswered(self, link: ShardLink) -> int:
        return sum(1 for item in self._in_flight if item.shard == link.index)

    def _load(self, link: ShardLink, reply: PullReply) -> None:
        assert reply.chunks is not None
        link.sink.load(reply.chunks)
        if reply.buffers is not None:
            self.model_buffers.load(reply.buffers)
        link.version = reply.version

    def _note_stop(self, reply: PullReply) -> None:
        if reply.stop and not self._stop.is_set():
            logger.info("the server is shutting down for good; stopping after in-flight pushes")
            self._stop.set()

    def _take_pushed_params(self, link: ShardLink, seq: int, pulled: PullReply) -> None:
        """Keeps the parameters the reply to push ``seq`` brought for the next refresh (loading them
        now would change the model under a step that is computing its gradients)."""
        self._note_stop(pulled)
        if pulled.paused:
            return  # the refresh pulls on its own and waits the pause out
        newest = link.pending.version if link.pending is not None else link.version
        if pulled.chunks is not None and pulled.version > newest:
            link.pending = pulled
        link.fresh_as_of = max(link.fresh_as_of, seq + 1)

    def _wants_params(self, seq: int) -> bool:
        """Whether push ``seq``'s reply should bring parameters: the next refresh is within the window."""
        next_refresh = (seq // self.pull_every + 1) * self.pull_every
        return self.pull_with_push and next_refresh - seq <= self.window

    def _pull_all(self, shards: list[ShardLink]) -> list[Any]:
        """Pulls from ``shards`` in parallel; a shard whose primary failed is pulled again from its successor."""
        return self._at_every_primary(shards, lambda link: link.client.pull(self.slot, link.registration.incarnation, link.version))

    def _pull_rows(self, parts: list[SparsePull]) -> list[SparsePull]:
        """Each shard's part of a sparse pull (``SparseRouter``), in parallel, as ``_pull_all``; retried on timeouts."""
        return self._with_retries(lambda: self._at_every_primary(
            self.shards, lambda link: link.client.pull_rows(self.slot, link.registration.incarnation, parts[link.index]),
        ))

    def _at_every_primary(self, shards: list[ShardLink], start: Callable[[ShardLink], transport.Pending]) -> list[Any]:
        """``result(start(link))`` for every link, the calls in flight together; a shard whose primary
        failed fails over (``_fail_over``) and is called again at its successor."""
        started: list[Any] = []
        for link in shards:
            try:
                started.append(start(link))
            except _PRIMARY_LOST as e:
                started.append(e)
        replies = []
        for link, pending in zip(shards, started):
            try:
                if isinstance(pending, Exception):
                    raise pending
                replies.append(self._result(link, pending))
            except _PRIMARY_LOST as e:
                replies.append(self._call_after_loss(link, functools.partial(_call_at, start, link), e))
        return replies

    def _result(self, link: ShardLink, pending: transport.Pending) -> Any:
        """``result(pending)``; raises NotPrimary instead once the shard's new primary announced itself
        (the old one may be frozen, and would keep this call waiting for the whole RPC timeout)."""
        if not pending.done():
            arrived = threading.Event()
            pending.on_done(lambda _: arrived.set())
            while not arrived.wait(_MOVED_POLL_S):
                if link.index in self._moved and self._move_confirmed(link):
                    raise NotPrimary(f"shard {link.index} has a new primary")
        return result(pending)

    def _move_confirmed(self, link: ShardLink) -> bool:
        """Whether the store's view of ``link``'s shard is newer than the one in use. Anyone who reaches
        this worker may call ``view_changed``, and anyone who reaches the store may write a view there:
        only a view the registry verifies (signed with the job secret, not older than one seen,
        ``rpcps.transport.registry``) moves a worker, so a stranger's announcement never does."""
        try:
            now = shard_view(link.index)
        except transport.StoreUnavailable:
            return False  # asked again on the next poll while the hint stands
        if now is not None and now.epoch > link.client.view.epoch:
            return True
        self._moved.discard(link.index)
        hint = (link.index, link.client.view.epoch)
        if hint not in self._hints_ignored:  # a stranger may send it over and over: say it once per view in use
            self._hints_ignored.add(hint)
            logger.warning(
                "shard %d: a new view was announced, but the store holds no newer view this worker can verify; ignored "
                "(further announcements for this view are ignored silently)", link.index,
            )
        return False

    def _fail_over(self, link: ShardLink, error: Exception) -> None:
        """Switches ``link`` to its shard's new primary and sends it every push of that shard still in
        the window, in step order (see the module docstring).

        Raises ``error`` again when the shard had no standby to take over, or none did within
        ``failover_timeout_s``: the caller then restarts the worker to rejoin, as without replicas.
        """
        started = time.monotonic()
        old = link.client.view
        try:
            now = shard_view(link.index)
        except transport.StoreUnavailable:
            # The coordinator is down too: the view in use says whether a standby will promote once
            # it is back (the new client below waits for that, up to failover_timeout_s).
            now = old
        if isinstance(error, _NOT_SERVING) and now is not None and now.epoch == old.epoch and now.primary == old.primary:
            return  # the store still names it: it serves without a lease for now (_call_after_loss calls it again)
        if now is None or (now.epoch == old.epoch and now.standby is None):
            raise error  # nobody to take over: the shard comes back from its snapshot
        logger.warning(  # the view's names come from the store, which has no authentication
            "shard %d's primary %s failed (%s); switching to its successor", link.index, peer_text(old.primary),
            peer_text(str(error), MESSAGE_LIMIT),
        )
        try:
            link.client = ServerClient(
                link.client.timeout_s, link.index, wait_s=self.config.failover_timeout_s, newer_than=old.epoch,
                secret=link.client.secret,
            )
        except (ShardUnavailable, transport.CallFailed, transport.StoreUnavailable) as e:
            logger.error("shard %d did not fail over within %.0fs: %s", link.index, self.config.failover_timeout_s, e)
            raise error from e
        self._moved.discard(link.index)
        self._recompute_lost(link)
        resent = self._resend_window(link)
        took = time.monotonic() - started
        self.metrics.failovers.inc()
        self.metrics.failover_seconds.set(took)
        self.metrics.pushes_resent.inc(resent)
        logger.warning(
            "shard %d: now served by %s (epoch %d) after %.0f ms; resent %d unacknowledged push(es)", link.index,
            peer_text(link.client.view.primary), link.client.view.epoch, 1000 * took, resent,
        )

    def _resend_window(self, link: ShardLink) -> int:
        """Sends every push of ``link``'s shard still in the window again, in step order; returns how many."""
        items = [item for item in self._in_flight if item.shard == link.index]
        for item in items:
            self._push(link, item)
        return len(items)

    def _ask_unleased_again(self, link: ShardLink, error: Exception) -> None:
        """The window's oldest push to ``link`` was answered ``NotPrimary`` or ``ServerStarting`` by the
        primary the view still names (a promoted standby whose claim is not granted yet, a primary
        stepping down): after ``_LEASE_RETRY_S`` the shard's window is sent to it again, as
        ``_call_after_loss`` does for a call. Raises ``error`` once ``failover_timeout_s`` has passed
        (the worker restarts to rejoin) or when this worker was told to stop. Before, the same answered
        push was read again at once, for good: a worker whose server stepped down while the store was
        gone spun a core and never stopped."""
        now = time.monotonic()
        if link.unleased_since is None:
            link.unleased_since = now
        if now - link.unleased_since >= self.config.failover_timeout_s or self._stop.wait(_LEASE_RETRY_S):
            raise error
        self._resend_window(link)

    def _recompute_lost(self, link: ShardLink) -> None:
        """After a failover: steps of this worker acknowledged by the old primary that the new one
        lacks (asynchronous replication, ``worker.acked``) are recomputed, and the parameters, which
        may hold them, are pulled again."""
        if not link.client.max_lag:
            return  # synchronous: the new primary holds every update this worker saw acknowledged, or pulled
        try:
            version = link.client.heartbeat(self.slot, link.registration.incarnation)
        except Exception as e:  # noqa: BLE001 - a gap left here is found by finish() and recomputed after a rejoin
            logger.warning("shard %d: could not read the new primary's version (%s); lost steps are found at the end", link.index, e)
            return
        lost = self._acked.lost(link.index, version)
        if version < link.version:  # what this worker holds includes updates the new history lacks
            link.version, link.fresh_as_of, link.pending = -1, -1, None
        if not lost:
            return
        self.metrics.pushes_lost.inc(len(lost))
        logger.warning(
            "shard %d: the new primary holds version %d; %d acknowledged step(s) of this worker applied after it (%s) were "
            "lost with the old primary (asynchronous replication): recomputing them", link.index, version, len(lost),
            ", ".join(f"step {a.seq} as version {a.version}" for a in lost),
        )
        self._redo.extendleft(_InFlight(a.seq, link.index, version, [], 0.0, a.batch) for a in reversed(lost))

    def _at_primary(self, link: ShardLink, call: Callable[[], Any]) -> Any:
        """``call()`` (which reads ``link.client`` when it runs) against the shard's primary, once more
        after a failover when the primary failed."""
        try:
            return call()
        except _PRIMARY_LOST as e:
            return self._call_after_loss(link, call, e)

    def _call_after_loss(self, link: ShardLink, call: Callable[[], Any], error: Exception) -> Any:
        """After ``call`` lost its shard's primary with ``error``: fails over, then calls again. While the
        primary the view names answers that it holds no lease yet (a promoted standby whose claim etcd
        has not granted, during an etcd election) or does not serve (``ServerStarting``: it withdrew its
        API to step down and restart), calls it again every ``_LEASE_RETRY_S`` up to
        ``failover_timeout_s``; then raises as before (the worker restarts to rejoin)."""
        deadline = time.monotonic() + self.config.failover_timeout_s
        while True:
            self._fail_over(link, error)
            try:
                return call()
            except _NOT_SERVING as e:
                if time.monotonic() >= deadline:
                    raise
                error = e
                time.sleep(_LEASE_RETRY_S)

    def _with_retries(self, call: Callable[[], Any]) -> Any:
        for attempt in range(self.config.max_retries + 1):
            try:
                return call()
            except transport.PeerTimeout:
                if attempt == self.config.max_retries:
                    raise
                self.metrics.retries.inc()
                backoff = min(0.2 * 2**attempt, 5.0)
                logger.warning("server timed out; retrying in %.1fs (attempt %d)", backoff, attempt + 1)
                time.sleep(backoff)
        raise AssertionError("unreachable")

    def _send(self, item: _InFlight) -> None:
        link = self.shards[item.shard]
        self._at_primary(link, lambda: self._push(link, item))
        self._in_flight.append(item)
        self.metrics.in_flight.set(len(self._in_flight))

    def _push(self, link: ShardLink, item: _InFlight) -> None:
        item.sent = time.perf_counter()
        item.future = link.client.push(
            self.slot, link.registration.incarnation, item.seq, item.base_version, item.payload or item.buffers, item.loss,
            link.version if self._wants_params(item.seq) else None,
            item.sparse,
            item.absent,
        )

    def _wait_for_free_slot(self, link: ShardLink) -> float:
        started = time.perf_counter()
        while not link.free:
            self._complete_oldest()
        # Harvest replies that already arrived so errors surface promptly.
        while self._in_flight and self._in_flight[0].future.done():
            self._complete_oldest()
        return time.perf_counter() - started

    def _drain_timed(self) -> float:
        started = time.perf_counter()
        while self._in_flight:
            self._complete_oldest()
        return time.perf_counter() - started

    def _complete_oldest(self) -> None:
        item = self._in_flight.popleft()
        self.metrics.in_flight.set(len(self._in_flight))
        link = self.shards[item.shard]
        try:
            reply: PushReply = self._result(link, item.future)
        except _PRIMARY_LOST as e:
            self._in_flight.appendleft(item)  # resent with the rest of the shard's window
            self.metrics.in_flight.set(len(self._in_flight))
            client = link.client
            self._fail_over(link, e)
            if link.client is client:  # not switched: the view still names a primary that does not serve
                self._ask_unleased_again(link, e)
            return
        except transport.PeerTimeout:
            if item.attempts > self.config.max_retries:
                raise
            # The server may or may not have applied it; it deduplicates by (slot, seq), so resend.
            self.metrics.retries.inc()
            logger.warning("shard %d: no reply to step %d's push within the RPC timeout (%.0fs); sending it again (attempt %d)",
                           item.shard, item.seq, link.client.timeout_s, item.attempts + 1)
            time.sleep(min(0.2 * 2 ** (item.attempts - 1), 5.0))
            item.attempts += 1
            self._send(item)
            return
        except PushRejected as e:
            link.free.append(item.buffers)
            self.stats.rejected += 1
            self.metrics.push_results["rejected"].inc()
            self._rejects_in_a_row += 1
            logger.error("%s", peer_text(str(e), MESSAGE_LIMIT))  # the server's words
            if self._rejects_in_a_row >= self.config.max_consecutive_rejects:
                raise TooManyRejects(f"{self._rejects_in_a_row} pushes in a row were rejected; last: {e}") from e
            return
        self.metrics.push_seconds.observe(time.perf_counter() - item.sent)
        link.last_reply = time.monotonic()
        link.unleased_since = None
        if reply.pulled is not None:
            self._take_pushed_params(link, item.seq, reply.pulled)
        if reply.status == PushStatus.PAUSED:  # not applied and not recorded: send it again once resumed
            self._stop.wait(self.config.pause_poll_s)
            self._send(item)
            return
        link.free.append(item.buffers)
        self.metrics.push_results[reply.status].inc()
        if reply.status == PushStatus.STALE:  # not recorded: recompute this step on fresh parameters
            self._redo.append(item)
            return
        self._rejects_in_a_row = 0
        if self._overlapped_rounds and link.pending is not None and not link.pending.holds_step(item.seq):
            # This round left the window but the kept reply misses it (its own reply brought no
            # parameters): folding that one would drop the round; the worker keeps its own until a
            # reply that holds it.
            link.pending = None
        if reply.status == PushStatus.APPLIED:
            self._acked.note(item.shard, item.seq, reply.version, item.batch)
            self.stats.applied += 1
            self.stats.staleness_sum += reply.staleness

    def _account(self, step_started: float, comm: float, loss: float | None, samples: int) -> None:
        elapsed = time.perf_counter() - step_started
        self.stats.steps += 1
        m = self.metrics
        if loss is not None:
            self.stats.note_loss(loss)
            m.loss.set(loss)
        m.steps.inc()
        m.samples.inc(samples)
        m.step_seconds.observe(elapsed)
        m.add_time(max(elapsed - comm, 0.0), comm)
        m.last_step.set_to_current_time()
        if self.device.type == "cuda":  # a CPU worker's gauges stay 0
            used, peak = memory_in_use(self.device)
            m.device_memory.set(used)
            m.device_memory_peak.set(peak)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            for link in self.shards:
                if time.monotonic() - link.last_reply < self.config.heartbeat_s:
                    continue  # a push was answered lately: the server knows we are alive
                try:
                    link.client.heartbeat(self.slot, link.registration.incarnation)
                except Exception as e:  # noqa: BLE001 - the training loop reports real failures
                    logger.debug("heartbeat to shard %d failed: %s", link.index, e)


def _call_at(start: Callable[[ShardLink], transport.Pending], link: ShardLink) -> Any:
    """``result(start(link))``: a call to one shard, made again after its primary was lost."""
    return result(start(link))
