"""The worker API's pure logic: settings with the CLI's precedence, a step's rules, the optimizer facade.

What needs servers (joining, replays, durability) is tested with real processes in
tests/integration/worker/test_own_loop.py.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from torch import nn

from worker.api import StepOptimizer, worker_config
from worker.step import Step, StepEnded


def test_settings_come_from_flags_env_torchrun_then_keywords_then_defaults() -> None:
    config, rest = worker_config(["--steps", "7", "--my-flag", "x"], environ={}, ps="h:1", steps=3, max_in_flight=4)
    assert (config.worker.steps, config.worker.max_in_flight, str(config.ps)) == (7, 4, "h:1")
    assert rest == ["--my-flag", "x"], "the script's own flags are left for its parser"
    env = {"RPCPS_MAX_IN_FLIGHT": "3", "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "5"}
    config, _ = worker_config([], environ=env, ps="h:1", max_in_flight=8, worker_index=0, num_workers=1)
    assert (config.worker.max_in_flight, config.worker.worker_index, config.worker.num_workers) == (3, 1, 2)
    assert str(config.ps) == "m:5", "torchrun's MASTER_ADDR/MASTER_PORT outrank a keyword"
    config, _ = worker_config([], environ={}, ps="h:1")
    assert config.worker.steps == 300  # the CLI's default


def test_unknown_and_bad_settings_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="stepz"):
        worker_config([], environ={}, ps="h:1", stepz=3)
    with pytest.raises(ValueError, match="max_in_flight"):
        worker_config([], environ={}, ps="h:1", max_in_flight=0)
    with pytest.raises(ValueError, match="--ps"):
        worker_config([], environ={})


class _Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, Any]] = []

    def push_step(self, step: Step, loss: float | None) -> None:
        self.calls.append(("push", step.index, loss))

    def skip_step(self, step: Step) -> None:
        self.calls.append(("skip", step.index, None))

    def zero_grad_step(self, step: Step) -> None:
        self.calls.append(("zero", step.index, None))

    def between_micro_batches(self, step: Step) -> None:
        self.calls.append(("between", step.index, None))


def test_a_step_ends_once_and_reports_its_loss_as_a_number() -> None:
    sink = _Sink()
    step = Step(3, ["a", "b"], False, 2, sink)
    assert step.micro_batches == ["a", "b"]
    step.zero_grad()
    step.push(torch.tensor(1.5))
    with pytest.raises(StepEnded, match="pushed already"):
        step.skip()
    step.zero_grad()  # after the end: nothing left to clear
    assert sink.calls == [("zero", 3, None), ("push", 3, 1.5)]
    assert Step(4, ("x", "y"), True, 1, sink).micro_batches == [("x", "y")]


def test_the_sink_hears_between_micro_batches_once_the_one_before_is_done() -> None:
    """Overlapped local steps fold a reply into the parameters there: never before the first
    micro-batch, never after the last, and only as the loop asks for the next one."""
    sink = _Sink()
    step = Step(5, ["a", "b", "c"], False, 3, sink)
    seen = []
    for batch in step.micro_batches:
        seen.append((batch, len(sink.calls)))
    assert seen == [("a", 0), ("b", 1), ("c", 2)] and sink.calls == [("between", 5, None)] * 2
    assert list(Step(6, "x", False, 1, sink).micro_batches) == ["x"] and len(sink.calls) == 2
    copied = pickle.loads(pickle.dumps(step.micro_batches))  # a DataLoader worker, torch.save: the plain list
    assert type(copied) is list and copied == ["a", "b", "c"] and len(sink.calls) == 2


class _Training:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.current: Step | None = None


def test_the_optimizer_facade_pushes_the_open_step_and_grad_scaler_skips_through_it() -> None:
    model = nn.Linear(3, 1)
    training = _Training(model)
    optimizer = StepOptimizer(training)  # type: ignore[arg-type]
    sink = _Sink()
    with pytest.raises(StepEnded, match="no step is open"):
        optimizer.step()
    training.current = Step(0, None, False, 1, sink)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(2, 3)).sum().backward()
    optimizer.zero_grad()
    assert optimizer.step() == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "a local step must never happen"
    # GradScaler: an Inf gradient makes scaler.step skip the optimizer and return None.
    training.current = Step(1, None, False, 1, sink)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    model.zero_grad()
    scaler.scale(model(torch.full((2, 3), float("inf"))).sum()).backward()
    scaler.unscale_(optimizer)
    assert scaler.step(optimizer) is None
    training.current.skip()
    scaler.update()
    assert [c[0] for c in sink.calls] == ["zero", "push", "skip"]


@pytest.mark.timeout(30)
def test_a_server_that_does_not_serve_its_shard_yet_makes_the_worker_rejoin_not_fail() -> None:
    """NotPrimary with no successor named (a server re-executing from its snapshot answered before it
    claimed its shard again) is a lost server: the worker restarts in place and rejoins. Before, it
    ended the worker with exit 1 (CI, test_stray_connections_to_every_port_do_not_take_the_system_down)."""
    from rpcps.errors import NotPrimary, ServerStarting, SignatureMismatch
    from worker.api import REJOIN_ON

    assert isinstance(NotPrimary("shard 0's primary has no lease right now"), REJOIN_ON)
    # A primary fenced by its etcd claim withdraws its API before it restarts (CI: a worker exited 1 on it).
    assert isinstance(ServerStarting("the parameter server is still starting (no model loaded yet); retry shortly"), REJOIN_ON)
    assert not isinstance(SignatureMismatch("wrong model"), REJOIN_ON), "a refusal still ends the worker"
