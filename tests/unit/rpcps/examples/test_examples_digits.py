"""The digits example: factories, shapes, a fixed disjoint split, seekable shards, and that it learns."""

from __future__ import annotations

import io
import itertools

import pytest
import torch

pytest.importorskip("sklearn", reason="rpcps.examples.digits needs scikit-learn (pip install rpcps[examples])")

from bench.reference_train import RunConfig, train
from rpcps import plugins
from rpcps.examples import digits
from rpcps.examples.stream import ShardedStream


def test_factories_load_through_plugin_specs() -> None:
    model = plugins.load_model("rpcps.examples.digits:model")
    data = plugins.load_data("rpcps.examples.digits:data", 1, 3)
    assert isinstance(data, ShardedStream) and hasattr(data, "seek")
    inputs, targets = next(iter(data))
    loss = plugins.load_loss(digits.RECIPE.loss)(model(inputs), targets)
    assert loss.shape == () and torch.isfinite(loss)


def test_batches_are_images_and_labels() -> None:
    inputs, targets = next(iter(digits.data(0, 2)))
    assert inputs.shape == (digits.BATCH_SIZE, 1, 8, 8) and inputs.dtype == torch.float32
    assert targets.shape == (digits.BATCH_SIZE,) and targets.dtype == torch.int64
    assert 0.0 <= float(inputs.min()) and float(inputs.max()) <= 1.0
    assert set(targets.tolist()) <= set(range(10))
    assert digits.model()(inputs).shape == (digits.BATCH_SIZE, digits.CLASSES)


def test_held_out_is_a_fixed_fifth_disjoint_from_training() -> None:
    s = digits.split()
    train, held = set(s.train_index.tolist()), set(s.held_index.tolist())
    assert not train & held
    assert train | held == set(range(1797))
    assert len(held) == 359
    held_images = torch.cat([x for x, _ in digits.eval_batches()])
    assert torch.equal(held_images, s.held_x)


@pytest.mark.parametrize("num_workers", [1, 3])
def test_worker_shards_are_disjoint_and_cover_the_training_split(num_workers: int) -> None:
    shards = [set(digits.data(i, num_workers).shard.tolist()) for i in range(num_workers)]
    for a, b in itertools.combinations(shards, 2):
        assert not a & b
    assert set().union(*shards) == set(range(len(digits.split().train_y)))


def test_seek_gives_the_batch_that_iterating_reaches() -> None:
    walked = list(itertools.islice(digits.data(2, 4), 30))  # 359-image shard: crosses two epochs
    jumped = digits.data(2, 4)
    jumped.seek(29)
    inputs, targets = next(iter(jumped))
    assert torch.equal(inputs, walked[29][0]) and torch.equal(targets, walked[29][1])


def test_model_has_batchnorm_buffers_including_an_int64_counter() -> None:
    buffers = dict(digits.model().named_buffers())
    counters = [name for name in buffers if name.endswith("num_batches_tracked")]
    assert len(counters) == 3 and all(buffers[n].dtype == torch.int64 for n in counters)
    assert all(p.dtype == torch.float32 for p in digits.model().parameters())


def test_model_seed_is_deterministic_and_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    a, b = digits.model(), digits.model()
    assert torch.equal(torch.rand(1), expected)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_evaluate_reports_loss_accuracy_and_samples_and_restores_the_mode() -> None:
    model = digits.model()
    scores = digits.evaluate(model)
    assert set(scores) == {"loss", "accuracy", "samples"}
    assert scores["samples"] == 359 and 0.0 <= scores["accuracy"] <= 0.3  # untrained: near chance
    assert model.training


def test_state_dict_round_trips_through_weights_only_load() -> None:
    model = train(RunConfig(example="digits", steps=5, optimizer="adam", lr=3e-3)).model
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert state["1.num_batches_tracked"].dtype == torch.int64 and int(state["1.num_batches_tracked"]) == 5
    fresh = digits.model(seed=1)
    fresh.load_state_dict(state)
    assert digits.evaluate(fresh) == digits.evaluate(model)


def test_a_short_run_beats_chance_clearly() -> None:
    report = train(RunConfig(example="digits", steps=60, optimizer="adam", lr=digits.RECIPE.lr)).report
    assert report["curve"][0]["accuracy"] < 0.3
    assert report["final"]["accuracy"] > 0.9, report["final"]
