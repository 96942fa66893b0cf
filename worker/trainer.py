"""The worker's training loop: compute on local data, push gradients asynchronously, pull parameters.

Pushes are fire-and-forget within a bounded window: step t+1 computes while step t's gradient is on
the wire. A window slot (and its gradient buffers) is reused only after its reply arrives, so a
buffer is never overwritten while TensorPipe may still be reading it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rpcps import plugins
from rpcps.errors import PushRejected
from rpcps.messages import PushReply, Registration
from rpcps.signature import FlatLayout, ModelSignature
from worker.client import ServerClient, ServerTimeout, result
from worker.device import GradientStager, load_parameters, memory_in_use, pick_device
from worker.metrics import WorkerMetrics

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class WorkerConfig:
    worker_index: int = 0
    """This worker's slot: which data shard it reads and whose progress the server keeps."""
    num_workers: int = 1
    """How many worker slots share the data (passed to the data factory)."""
    steps: int = 300
    """Total steps for this slot, counted across restarts (a restarted worker resumes)."""
    pull_every: int = 1
    """Refresh parameters every this many steps."""
    max_in_flight: int = 2
    """Pushes on the wire at once before the loop waits for the oldest reply."""
    device: str = "auto"
    model: str = plugins.BUILTIN_MODEL
    data: str = plugins.BUILTIN_DATA
    loss: str = "cross_entropy"
    heartbeat_s: float = 2.0
    """How often an otherwise idle worker tells the server it is alive."""
    max_retries: int = 30
    """Timeouts in a row on one call before the worker gives up on a hung server."""
    max_consecutive_rejects: int = 10
    """Rejected pushes in a row before the worker stops (something is wrong with its gradients)."""
    pause_poll_s: float = 0.5

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if not 0 <= self.worker_index < self.num_workers:
            raise ValueError(f"worker_index must be in [0, {self.num_workers}) for {self.num_workers} workers, got {self.worker_index}")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if self.pull_every < 1:
            raise ValueError(f"pull_every must be >= 1, got {self.pull_every}")
        if not 1 <= self.max_in_flight <= 64:
            raise ValueError(f"max_in_flight must be in [1, 64], got {self.max_in_flight}")
        if self.heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")
        if self.max_retries < 0 or self.max_consecutive_rejects < 1:
            raise ValueError("max_retries must be >= 0 and max_consecutive_rejects >= 1")


class TooManyRejects(RuntimeError):
    pass


@dataclass
class _InFlight:
    seq: int
    base_version: int
    buffers: list[torch.Tensor]
    loss: float
    future: Any
    sent: float
    attempts: int = 1


@dataclass
class WorkerStats:
    losses: list[float] = field(default_factory=list)
    steps: int = 0
    applied: int = 0
    rejected: int = 0
    staleness_sum: int = 0
    started: float = field(default_factory=time.monotonic)

    def summary(self, next_step: int, reconnects: int) -> dict[str, Any]:
        wall = time.monotonic() - self.started
        head, tail = self.losses[:10], self.losses[-10:]
        return {
            "role": "worker",
            "initial_loss": sum(head) / len(head) if head else None,
            "final_loss": sum(tail) / len(tail) if tail else None,
            "steps": self.steps,
            "next_step": next_step,
            "updates_applied": self.applied,
            "pushes_rejected": self.rejected,
            "mean_staleness": self.staleness_sum / self.applied if self.applied else 0.0,
            "updates_per_second": self.applied / wall if wall > 0 else 0.0,
            "wall_seconds": wall,
            "reconnects": reconnects,
        }


class Trainer:
    def __init__(self, config: WorkerConfig, client: ServerClient, rpc_name: str, metrics: WorkerMetrics) -> None:
        self.config = config
        self.client = client
        self.metrics = metrics
        self.device = pick_device(config.device)
        self.model = plugins.load_model(config.model).to(self.device)
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = plugins.load_loss(config.loss)
        self.signature = ModelSignature.of_module(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.registration: Registration = client.register(config.worker_index, rpc_name, self.signature.to_wire())
        self.layout = FlatLayout(self.signature, self.registration.chunk_bytes)
        if self.layout.chunk_numels != tuple(self.registration.chunk_numels):
            raise RuntimeError("the server packs parameters differently from this worker; are both running the same rpcps version?")
        self.stager = GradientStager(self.layout, self.params, self.device)
        self.version = -1
        self.step = self.registration.next_step
        self.stats = WorkerStats()
        self._free: list[list[torch.Tensor]] = [self.stager.new_buffers() for _ in range(config.max_in_flight)]
        self._in_flight: deque[_InFlight] = deque()
        self._rejects_in_a_row = 0
        self._stop = threading.Event()
        logger.info(
            "slot %d registered (incarnation %s) on %s; %d parameters in %d chunks; resuming at step %d of %d",
            config.worker_index, self.registration.incarnation, self.device, self.signature.numel, len(self.layout),
            self.step, config.steps,
        )

    @property
    def slot(self) -> int:
        return self.config.worker_index

    def run(self) -> dict[str, Any]:
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        heartbeat.start()
        try:
            batches = self._batches()
            first = True
            while self.step < self.config.steps and not self._stop.is_set():
                step_started = time.perf_counter()
                comm = 0.0
                if first or self.step % self.config.pull_every == 0:
                    comm += self._refresh()
                    first = False
                    if self._stop.is_set():
                        break
                inputs, targets = next(batches)
                inputs = inputs.to(self.device, non_blocking=True)
                targets = targets.to(self.device, non_blocking=True)
                for p in self.params:
                    p.grad = None
                loss = self.loss_fn(self.model(inputs), targets)
                loss.backward()
                comm += self._wait_for_free_slot()
                buffers = self._free.pop()
                self.stager.stage(buffers)
                self.stager.wait()
                loss_value = float(loss.detach())
                self._send(_InFlight(self.step, self.version, buffers, loss_value, None, 0.0))
                self.step += 1
                self._account(step_started, comm, loss_value, len(inputs))
            self._drain()
        finally:
            self._stop.set()
        return self.stats.summary(self.step, 0)

    def stop(self) -> None:
        self._stop.set()

    # ---- helpers -------------------------------------------------------------------------------

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        data = plugins.load_data(self.config.data, self.slot, self.config.num_workers)
        if hasattr(data, "seek"):
            data.seek(self.step)
            return iter(data)
        # No seek: skip to the recorded position by reading (and discarding) what came before.
        return itertools.islice(iter(data), self.step, None)

    def _refresh(self) -> float:
        """Pulls parameters if they changed; waits while the server is paused. Returns blocked time."""
        started = time.perf_counter()
        while True:
            reply = self._with_retries(lambda: result(self.client.pull(self.slot, self.registration.incarnation, self.version)))
            if reply.stop:
                logger.info("the server is shutting down for good; stopping after in-flight pushes")
                self._stop.set()
                break
            if reply.chunks is not None:
                load_parameters(self.layout, self.params, reply.chunks)
                self.version = reply.version
                self.metrics.model_version.set(reply.version)
            if not reply.paused or self._stop.is_set():
                break
            self._stop.wait(self.config.pause_poll_s)
        elapsed = time.perf_counter() - started
        self.metrics.pull_seconds.observe(elapsed)
        return elapsed

    def _with_retries(self, call: Callable[[], Any]) -> Any:
        for attempt in range(self.config.max_retries + 1):
            try:
                return call()
            except ServerTimeout:
                if attempt == self.config.max_retries:
                    raise
                self.metrics.retries.inc()
                backoff = min(0.2 * 2**attempt, 5.0)
                logger.warning("server timed out; retrying in %.1fs (attempt %d)", backoff, attempt + 1)
                time.sleep(backoff)
        raise AssertionError("unreachable")

    def _send(self, item: _InFlight) -> None:
        item.sent = time.perf_counter()
        item.future = self.client.push(self.slot, self.registration.incarnation, item.seq, item.base_version, item.buffers, item.loss)
        self._in_flight.append(item)
        self.metrics.in_flight.set(len(self._in_flight))

    def _wait_for_free_slot(self) -> float:
        started = time.perf_counter()
        while not self._free:
            self._complete_oldest()
        # Harvest replies that already arrived so errors surface promptly.
        while self._in_flight and self._in_flight[0].future.done():
            self._complete_oldest()
        return time.perf_counter() - started

    def _drain(self) -> None:
        while self._in_flight:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        item = self._in_flight[0]
        try:
            reply: PushReply = result(item.future)
        except ServerTimeout:
            if item.attempts > self.config.max_retries:
                raise
            # The server may or may not have applied it; it deduplicates by (slot, seq), so resend.
            self.metrics.retries.inc()
            self._in_flight.popleft()
            time.sleep(min(0.2 * 2 ** (item.attempts - 1), 5.0))
            item.attempts += 1
            self._send(item)
            return
        except PushRejected as e:
            self._in_flight.popleft()
            self._free.append(item.buffers)
            self.stats.rejected += 1
            self.metrics.pushes.labels("rejected").inc()
            self._rejects_in_a_row += 1
            logger.error("%s", e)
            if self._rejects_in_a_row >= self.config.max_consecutive_rejects:
                raise TooManyRejects(f"{self._rejects_in_a_row} pushes in a row were rejected; last: {e}") from e
            return
        self._in_flight.popleft()
        self.metrics.in_flight.set(len(self._in_flight))
        self.metrics.push_seconds.observe(time.perf_counter() - item.sent)
        if reply.status == "paused":  # not applied and not recorded: send it again once resumed
            self._stop.wait(self.config.pause_poll_s)
            self._send(item)
            return
        self._free.append(item.buffers)
        self.metrics.pushes.labels(reply.status).inc()
        self._rejects_in_a_row = 0
        if reply.status == "applied":
            self.stats.applied += 1
            self.stats.staleness_sum += reply.staleness

    def _account(self, step_started: float, comm: float, loss: float, samples: int) -> None:
        elapsed = time.perf_counter() - step_started
        self.stats.steps += 1
        self.stats.losses.append(loss)
        m = self.metrics
        m.steps.inc()
        m.samples.inc(samples)
        m.loss.set(loss)
        m.step_seconds.observe(elapsed)
        m.add_time(max(elapsed - comm, 0.0), comm)
        m.last_step.set_to_current_time()
        used, peak = memory_in_use(self.device)
        m.device_memory.set(used)
        m.device_memory_peak.set(peak)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            try:
                self.client.heartbeat(self.slot, self.registration.incarnation)
            except Exception as e:  # noqa: BLE001 - the training loop reports real failures
                logger.debug("heartbeat failed: %s", e)
