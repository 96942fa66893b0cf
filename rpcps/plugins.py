"""Loads the user's model, data and loss from ``package.module:attribute`` specs.

The same specs are given to every role, so the server and the workers build the same model.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

BUILTIN_MODEL = "rpcps.tasks:teacher_student_model"
BUILTIN_DATA = "rpcps.tasks:teacher_student_data"
BUILTIN_LOSSES: dict[str, Callable[..., torch.Tensor]] = {"cross_entropy": F.cross_entropy, "mse": F.mse_loss}

Batch = tuple[torch.Tensor, torch.Tensor]


class PluginError(ValueError):
    """A model, data or loss spec could not be loaded or returned the wrong kind of object."""


def resolve(spec: str, what: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PluginError(f"--{what} {spec!r} must look like 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PluginError(f"--{what} {spec!r}: cannot import {module_name!r} ({e}); is it on PYTHONPATH?") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise PluginError(f"--{what} {spec!r}: module {module_name!r} has no attribute {attr!r}") from None


def resolve_callable(spec: str, what: str) -> Callable[..., Any]:
    """``resolve`` for a factory or function: a PluginError names the spec when it is not callable."""
    target = resolve(spec, what)
    if not callable(target):
        raise PluginError(f"--{what} {spec!r} is not callable (it is a {type(target).__name__}); name a function")
    return target


def load_model(spec: str) -> torch.nn.Module:
    factory = resolve_callable(spec, "model")
    try:
        model = factory()
    except TypeError as e:  # most often a class or function that needs arguments: not a factory
        raise PluginError(f"--model {spec!r} could not be called with no arguments ({e}); name a factory function") from e
    if not isinstance(model, torch.nn.Module):
        raise PluginError(f"--model {spec!r} returned {type(model).__name__}, expected a torch.nn.Module")
    return model


def load_data(spec: str, worker_index: int, num_workers: int) -> Iterable[Batch]:
    factory = resolve_callable(spec, "data")
    try:
        data = factory(worker_index, num_workers)
    except TypeError as e:
        raise PluginError(f"--data {spec!r} could not be called as factory(worker_index, num_workers) ({e})") from e
    if not isinstance(data, Iterable):
        raise PluginError(
            f"--data {spec!r} returned {type(data).__name__}, expected an iterable of (inputs, targets) batches"
        )
    return data


def load_loss(spec: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if spec in BUILTIN_LOSSES:
        return BUILTIN_LOSSES[spec]
    if ":" not in spec:
        raise PluginError(f"--loss {spec!r}: use one of {sorted(BUILTIN_LOSSES)} or 'package.module:function'")
    return resolve_callable(spec, "loss")


def check_specs(model: str, data: str, loss: str) -> None:
    """Fails with a PluginError naming the first bad spec, before a launcher starts any process.

    The model factory is called (its return type is the check); the data factory only resolved and
    checked callable: calling it may read a whole dataset, and each worker checks what it returns
    at its start (a bad return is its one-line error and exit 2, which ``local`` shows at once).
    """
    load_model(model)
    resolve_callable(data, "data")
    load_loss(loss)
