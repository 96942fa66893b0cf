"""rpcps.model_device: the device a model's inputs go to, and both scorers with a model that holds no tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from evaluator.scoring import loss_and_accuracy
from rpcps.examples.evaluation import score
from rpcps.model_device import model_device

# The meta device stands in for a GPU: a model's tensors live there, and the answer must say so.
META = torch.device("meta")


def test_a_model_is_where_its_first_parameter_is() -> None:
    assert model_device(nn.Linear(2, 2, device=META)) == META
    assert model_device(nn.Linear(2, 2)) == torch.device("cpu")


def test_a_model_with_buffers_only_is_where_its_first_buffer_is() -> None:
    model = nn.BatchNorm1d(3, affine=False, device=META)
    assert list(model.parameters()) == [] and model_device(model) == META


def test_a_model_without_tensors_computes_on_the_cpu() -> None:
    assert model_device(nn.Sequential(nn.Identity(), nn.ReLU())) == torch.device("cpu")


def test_both_scorers_score_a_model_without_parameters() -> None:
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
    targets = torch.tensor([0, 1, 1])
    expected = float(F.cross_entropy(logits, targets))
    scores = loss_and_accuracy(F.cross_entropy)(nn.Identity(), [(logits, targets)])
    assert scores["loss"] == pytest.approx(expected) and scores["accuracy"] == 2 / 3
    example = score(nn.Identity(), [(logits, targets)])
    assert example.loss == pytest.approx(expected) and example.accuracy == 2 / 3 and example.targets == 3
