"""bench/reference_train.py: settings, the JSON it prints, and that a step averages its batches' gradients."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("sklearn", reason="these runs train rpcps.examples.digits, which needs scikit-learn")

from bench.reference_train import RunConfig, main, train
from rpcps.examples import digits


def test_main_prints_the_settings_curve_and_final_scores(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--example", "digits", "--steps", "4", "--streams", "2", "--eval-every", "2"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["optimizer"], report["lr"]) == (digits.RECIPE.optimizer, digits.RECIPE.lr)
    assert report["streams"] == 2 and report["batches_per_step"] == 1 and report["batches_seen"] == 4
    assert [p["step"] for p in report["curve"]] == [0, 2, 4]
    assert report["final"] == report["curve"][-1]
    assert {"loss", "accuracy", "samples", "train_seconds", "train_loss"} <= set(report["final"])
    assert report["torch_threads"] >= 1 and report["train_seconds"] > 0
    # digits has BatchNorm buffers, so the report also scores its parameters with untrained buffers.
    assert set(report["final_params_only"]) == {"loss", "accuracy", "samples"}
    assert report["final_params_only"] != {k: report["final"][k] for k in ("loss", "accuracy", "samples")}


def test_streams_default_to_the_global_batch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--example", "digits", "--steps", "1", "--batches-per-step", "3"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["streams"] == 3 and report["batches_seen"] == 3


def test_bad_settings_exit_2_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--example", "digits", "--steps", "0"]) == 2
    assert "steps must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"example": "mnist"}, "example must be one of"),
        ({"optimizer": "lbfgs"}, "optimizer must be one of"),
        ({"optimizer_args": {"lr": 1.0}}, "optimizer_args must not hold 'lr'"),
        ({"batches_per_step": 0}, "batches_per_step must be >= 1"),
        ({"eval_every": -1}, "eval_every must be >= 0"),
        ({"eval_batches": 0}, "eval_batches must be >= 1"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"example": "digits", "steps": 1, "optimizer": "sgd", "lr": 0.1, **kwargs}
    with pytest.raises(ValueError, match=message):
        RunConfig(**args)  # type: ignore[arg-type]


def test_one_step_applies_the_mean_gradient_of_one_batch_per_stream() -> None:
    lr = 0.5
    trained = train(RunConfig(example="digits", steps=1, optimizer="sgd", lr=lr, batches_per_step=2, streams=2)).model
    expected = digits.model()
    for i in range(2):
        inputs, targets = next(iter(digits.data(i, 2)))
        (F.cross_entropy(expected(inputs), targets) / 2).backward()
    with torch.no_grad():
        for p in expected.parameters():
            p -= lr * p.grad
    for (name, want), got in zip(expected.state_dict().items(), trained.state_dict().values()):
        torch.testing.assert_close(got, want, msg=name)
