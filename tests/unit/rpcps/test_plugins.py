"""Loading model/data/loss plug-ins from 'package.module:name' specs; every failure names the spec."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rpcps import plugins
from rpcps.plugins import PluginError


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "my_plugin_mod.py").write_text(
        textwrap.dedent(
            """
            import torch

            NOT_CALLABLE = 3

            def model():
                return torch.nn.Linear(2, 2)

            def not_a_model():
                return "linear"

            def data(worker_index, num_workers):
                return [(torch.zeros(1, 2), torch.zeros(1, 2))] * (worker_index + num_workers)

            def loss(out, target):
                return (out - target).abs().mean()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_plugin_error_is_a_value_error() -> None:
    # cli.main turns ValueError into "error: ..." and exit code 2; plug-in errors must take that path.
    assert issubclass(PluginError, ValueError)


@pytest.mark.parametrize("spec", ["no_colon", ":model", "module:", ""])
def test_malformed_spec_shows_the_expected_form(spec: str) -> None:
    with pytest.raises(PluginError, match=f"--model '{spec}' must look like 'package.module:name'"):
        plugins.load_model(spec)


def test_unimportable_module_suggests_pythonpath() -> None:
    with pytest.raises(PluginError, match=r"--model 'no_such_mod_xyz:m': cannot import 'no_such_mod_xyz' .*is it on PYTHONPATH\?"):
        plugins.load_model("no_such_mod_xyz:m")


def test_missing_attribute_is_named(plugin_dir: Path) -> None:
    with pytest.raises(PluginError, match="--data 'my_plugin_mod:nope': module 'my_plugin_mod' has no attribute 'nope'"):
        plugins.load_data("my_plugin_mod:nope", 0, 1)


def test_factory_returning_a_non_module_is_refused(plugin_dir: Path) -> None:
    with pytest.raises(PluginError, match="--model 'my_plugin_mod:not_a_model' returned str, expected a torch.nn.Module"):
        plugins.load_model("my_plugin_mod:not_a_model")


def test_good_specs_load(plugin_dir: Path) -> None:
    assert isinstance(plugins.load_model("my_plugin_mod:model"), torch.nn.Linear)
    assert len(plugins.load_data("my_plugin_mod:data", 2, 3)) == 5
    loss = plugins.load_loss("my_plugin_mod:loss")
    assert float(loss(torch.ones(2), torch.zeros(2))) == 1.0
    assert plugins.load_loss("mse") is F.mse_loss


def test_bad_loss_specs_are_explained(plugin_dir: Path) -> None:
    with pytest.raises(PluginError, match=r"--loss 'l1': use one of \['cross_entropy', 'mse'\] or 'package.module:function'"):
        plugins.load_loss("l1")
    with pytest.raises(PluginError, match="--loss 'my_plugin_mod:NOT_CALLABLE' is not callable"):
        plugins.load_loss("my_plugin_mod:NOT_CALLABLE")


def test_targets_that_are_not_factories_are_refused_by_name(plugin_dir: Path) -> None:
    with pytest.raises(PluginError, match=r"--model 'my_plugin_mod:NOT_CALLABLE' is not callable \(it is a int\)"):
        plugins.load_model("my_plugin_mod:NOT_CALLABLE")
    with pytest.raises(PluginError, match=r"--model 'torch.nn:Linear' could not be called with no arguments"):
        plugins.load_model("torch.nn:Linear")
    with pytest.raises(PluginError, match=r"--data 'my_plugin_mod:model' could not be called as factory\(worker_index, num_workers\)"):
        plugins.load_data("my_plugin_mod:model", 0, 1)
    with pytest.raises(PluginError, match="--data 'my_plugin_mod:NOT_CALLABLE' is not callable"):
        plugins.check_specs("my_plugin_mod:model", "my_plugin_mod:NOT_CALLABLE", "mse")


def test_data_that_is_not_iterable_is_refused(plugin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import my_plugin_mod  # type: ignore[import-not-found]

    monkeypatch.setattr(my_plugin_mod, "numbers", lambda worker_index, num_workers: 7, raising=False)
    with pytest.raises(PluginError, match=r"--data 'my_plugin_mod:numbers' returned int, expected an iterable of \(inputs, targets\)"):
        plugins.load_data("my_plugin_mod:numbers", 0, 1)


def test_data_whose_first_batch_is_not_a_pair_of_tensors_is_refused_saying_what_it_is() -> None:
    pair = (torch.zeros(1, 2), torch.zeros(1))
    with pytest.raises(PluginError, match=r"^--data 'm:d' returned a list whose first batch is int, expected an \(inputs, targets\) "
                                          r"pair of tensors \(or of objects with a \.to\(device\) method\)$"):
        plugins.checked_batches("m:d", [1, 2, 3])
    with pytest.raises(PluginError, match=r"whose first batch is a tuple of \(Tensor, Tensor, Tensor\), expected"):
        plugins.checked_batches("m:d", [(*pair, torch.zeros(1))])
    with pytest.raises(PluginError, match=r"whose first batch is a tuple of \(Tensor, str\), expected"):
        plugins.checked_batches("m:d", iter([(pair[0], "labels")]))
    with pytest.raises(PluginError, match=r"^--data 'm:d' returned an empty list, expected an iterable of \(inputs, targets\) batches$"):
        plugins.checked_batches("m:d", [])


def test_a_batch_of_the_models_own_type_with_a_to_method_is_accepted() -> None:
    from rpcps.examples.ctr import CtrBatch

    batch = (CtrBatch(torch.zeros(2, 13), torch.zeros(2, 26, dtype=torch.long)), torch.zeros(2))
    assert plugins.checked_batches("m:d", [batch]) == [batch]
    with pytest.raises(PluginError, match=r"whose first batch is a tuple of \(type, Tensor\), expected"):
        plugins.checked_batches("m:d", [(CtrBatch, torch.zeros(2))])  # the class itself has .to, but is no batch


def test_checked_data_still_yields_its_first_batch() -> None:
    batches = [(torch.full((1,), float(i)), torch.zeros(1)) for i in range(3)]
    assert plugins.checked_batches("m:d", batches) is batches  # re-iterable: a fresh iterator starts at batch 0 again
    one_shot = plugins.checked_batches("m:d", iter(batches))  # the batch the check read is put in front again
    assert [float(x) for x, _ in one_shot] == [0.0, 1.0, 2.0]


def test_check_specs_calls_the_data_factory_unless_a_script_reads_the_data(plugin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import my_plugin_mod  # type: ignore[import-not-found]

    monkeypatch.setattr(my_plugin_mod, "dicts", lambda worker_index, num_workers: [{"x": 1}], raising=False)
    plugins.check_specs("my_plugin_mod:model", "my_plugin_mod:data", "mse", num_workers=2)
    with pytest.raises(PluginError, match=r"--data 'my_plugin_mod:dicts' returned a list whose first batch is dict"):
        plugins.check_specs("my_plugin_mod:model", "my_plugin_mod:dicts", "mse", num_workers=2)
    plugins.check_specs("my_plugin_mod:model", "my_plugin_mod:dicts", "mse", own_loop=True)  # a --worker-script's own format
