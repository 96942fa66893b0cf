"""The sidecar evaluator's parts in-process: the read-only observe call, the observer (signature check,
shards, buffers), the default scores, the best model and its carry-over, the settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from torch import nn

from cli.main import parse
from evaluator.config import EvaluatorConfig, EvaluatorRunConfig
from evaluator.metrics import EvaluatorMetrics
from evaluator.observer import Observer
from evaluator.runner import BestModel
from evaluator.scoring import CannotScore, check_scorable, checked, loss_and_accuracy
from harness.inprocess import InProcessServer, pack
from ps.core.config import ServerCoreConfig
from ps.core.optim import OptimizerConfig
from rpcps import endpoints
from rpcps.address import Address
from rpcps.errors import SignatureMismatch
from rpcps.messages import ErrorReply
from rpcps.model_file import load_state_dict
from rpcps.settings import declared, to_argv
from tests.unit.test_sparse_server import TinyModel


def bn_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


class _Done:
    """A reply already in, as ``worker.client.result`` waits for one."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def wait(self) -> Any:
        return self.value


class _Client:
    """The observe call of ``worker.client.ServerClient``, answered by an in-process server."""

    def __init__(self, server: InProcessServer) -> None:
        self.server = server
        self.calls = 0

    def observe(self, have_version: int) -> _Done:
        self.calls += 1
        return _Done(self.server.observe(have_version))


def _servers(model: nn.Module, shards: int) -> list[InProcessServer]:
    sgd = OptimizerConfig(name="sgd", kwargs={"lr": 0.5})
    return [
        InProcessServer(model, ServerCoreConfig(optimizer=sgd, chunk_bytes=1024, shard_count=shards, shard_index=k))
        for k in range(shards)
    ]


def _step(servers: list[InProcessServer], seq: int) -> None:
    """One push to every shard (gradients of ones; new buffers to shard 0) from slot 0."""
    for k, server in enumerate(servers):
        incarnation = server.register(0, "w", server.model_signature.to_wire()).incarnation
        chunks = pack(server.layout, [torch.ones(s.spec.shape) for s in server.layout.slots])
        buffers = [torch.full((8,), float(seq)), torch.full((8,), 2.0), torch.tensor(seq)] if k == 0 else []
        server.push(0, incarnation, seq, server.version, [*chunks, *buffers])


@pytest.mark.parametrize("shards", [1, 2])
def test_the_observer_holds_the_servers_newest_parameters_and_buffers(shards: int) -> None:
    servers = _servers(bn_model(), shards)
    local = bn_model(seed=9)
    clients = [_Client(s) for s in servers]
    observer = Observer(local, clients)  # type: ignore[arg-type]
    assert observer.refresh() and observer.version == 0
    assert not observer.refresh()  # nothing new: nothing sent, nothing loaded
    _step(servers, 1)
    assert observer.refresh() and observer.version == shards
    held = {**servers[0].model_state()[1], **(servers[1].model_state()[1] if shards > 1 else {})}
    for name, value in local.state_dict().items():
        assert torch.equal(value, held[name]), name
    assert int(local.state_dict()["1.num_batches_tracked"]) == 1
    assert all(s.stats.pushes_received == 1 for s in servers)  # observing changed nothing on the servers


def test_observe_needs_no_slot_and_leaves_no_record() -> None:
    server = _servers(bn_model(), 1)[0]
    observation = server.observe(-1)
    assert observation.chunks is not None and observation.version == 0
    assert server.status().workers == ()


def test_a_different_model_is_refused_naming_the_difference() -> None:
    servers = _servers(bn_model(), 1)
    other = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, track_running_stats=False), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(SignatureMismatch, match="buffer '1.running_mean' is missing from the evaluator's model"):
        Observer(other, [_Client(servers[0])]).refresh()  # type: ignore[list-item]


def test_the_observe_endpoint_answers_errors_as_replies() -> None:
    assert isinstance(endpoints.observe(object(), 0), ErrorReply)  # no server published: a clean refusal


def test_default_scores_are_mean_loss_and_accuracy_weighted_by_batch_size() -> None:
    model = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))
    batches = [(torch.tensor([[1.0, 0.0]]), torch.tensor([0])), (torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]), torch.tensor([1, 1, 0]))]
    scores = loss_and_accuracy(nn.functional.cross_entropy)(model, batches)
    assert scores["accuracy"] == 0.75
    every = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    with torch.no_grad():
        assert scores["loss"] == pytest.approx(float(nn.functional.cross_entropy(model(every[0]), every[1])))
    regression = loss_and_accuracy(nn.functional.mse_loss)(model, [(torch.ones(3, 2), torch.zeros(3, 2))])
    assert set(regression) == {"loss"}


@pytest.mark.parametrize("bad", [None, {"accuracy": 1.0}, {"loss": float("nan")}])
def test_scores_must_hold_a_loss(bad: Any) -> None:
    with pytest.raises(ValueError, match="loss"):
        checked(bad, "the evaluation")


def test_the_best_model_is_kept_and_carried_across_a_restart(tmp_path: Path) -> None:
    out = tmp_path / "best.pt"
    config = EvaluatorConfig(eval_data="x:y", export_best=str(out), best_metric="accuracy", best_mode="max")
    metrics = EvaluatorMetrics(CollectorRegistry())
    best = BestModel(config, metrics, None)
    model = bn_model()
    best.offer(3, {"loss": 1.0, "accuracy": 0.5}, model)
    assert load_state_dict(out).keys() == model.state_dict().keys()
    first = out.stat().st_mtime_ns
    best.offer(4, {"loss": 0.5, "accuracy": 0.4}, model)  # lower accuracy: not better
    assert out.stat().st_mtime_ns == first and best.version == 3
    again = BestModel(config, EvaluatorMetrics(CollectorRegistry()), best.to_carry())
    assert (again.value, again.version) == (0.5, 3)
    assert json.loads(best.to_carry()) == {"value": 0.5, "version": 3}


def test_a_failed_best_export_is_counted_not_fatal(tmp_path: Path) -> None:
    metrics = EvaluatorMetrics(CollectorRegistry())
    best = BestModel(EvaluatorConfig(eval_data="x:y", export_best=str(tmp_path / "gone" / "best.pt")), metrics, None)
    best.offer(1, {"loss": 1.0}, bn_model())
    assert metrics.registry.get_sample_value("rpcps_evaluator_failures_total", {"stage": "export"}) == 1
    assert best.value == 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_seconds": 0}, "every_seconds must be > 0"),
        ({"best_mode": "up"}, "best_mode must be one of"),
        ({"max_evaluations": -1}, "max_evaluations must be >= 0"),
    ],
)
def test_settings_are_validated_naming_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EvaluatorConfig(**kwargs)


def test_the_process_needs_a_server_and_held_out_data() -> None:
    with pytest.raises(ValueError, match="--ps"):
        EvaluatorRunConfig(evaluator=EvaluatorConfig(eval_data="x:y"))
    with pytest.raises(ValueError, match="--eval-data"):
        EvaluatorRunConfig(ps=Address("127.0.0.1", 1))


def test_local_starts_the_evaluator_with_a_command_line_that_reproduces_its_config() -> None:
    config = parse(["local", "--model", "m:f", "--loss", "mse", "--eval-data", "m:held", "--every-seconds", "2",
                    "--best-mode", "max", "--best-metric", "accuracy"])[1]
    assert config.evaluator.model == config.worker.model == "m:f" and config.evaluator.loss == "mse"
    child = EvaluatorRunConfig(ps=Address("127.0.0.1", 4000), metrics_port=0, evaluator=config.evaluator)
    assert parse(["evaluate", *to_argv(child, declared(EvaluatorRunConfig))])[1] == child
    assert parse(["local", "--model", "m:f"])[1].evaluator.eval_data is None  # no --eval-data: no evaluator


def test_a_model_with_sparse_tables_is_refused_with_what_to_do_instead() -> None:
    check_scorable(nn.Linear(2, 1), "m:linear")  # a dense model is scorable
    with pytest.raises(CannotScore, match=r"cannot score --model m:tiny yet: it has 2 sparse tables.*load_export"):
        check_scorable(TinyModel(), "m:tiny")
