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


def load_model(spec: str) -> torch.nn.Module:
    factory = resolve(spec, "model")
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise PluginError(f"--model {spec!r} returned {type(model).__name__}, expected a torch.nn.Module")
    return model


def load_data(spec: str, worker_index: int, num_workers: int) -> Iterable[Batch]:
    factory = resolve(spec, "data")
    return factory(worker_index, num_workers)


def load_loss(spec: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if spec in BUILTIN_LOSSES:
        return BUILTIN_LOSSES[spec]
    if ":" not in spec:
        raise PluginError(f"--loss {spec!r}: use one of {sorted(BUILTIN_LOSSES)} or 'package.module:function'")
    fn = resolve(spec, "loss")
    if not callable(fn):
        raise PluginError(f"--loss {spec!r} is not callable")
    return fn
