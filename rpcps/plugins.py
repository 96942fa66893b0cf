"""Loads the user's model, data and loss from ``package.module:attribute`` specs.

The same specs are given to every role, so the server and the workers build the same model.
"""

from __future__ import annotations

import importlib
import itertools
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


def checked_batches(spec: str, data: Iterable[Any]) -> Iterable[Batch]:
    """``data`` once its first batch is an ``(inputs, targets)`` pair the built-in loop can unpack and
    move to its device (tensors, or objects with ``.to``): a PluginError saying what it is instead, before the worker joins anything (later it
    would be a traceback at the first step, and a crash ``local`` restarts).

    A one-shot iterator without ``seek`` comes back with the batch read here put in front again; an
    iterable that makes a fresh iterator each time (a list, a DataLoader), or one with ``seek`` (the
    trainer seeks before it reads), comes back as it is.
    """
    items = iter(data)
    try:
        first = next(items)
    except StopIteration:
        raise PluginError(
            f"--data {spec!r} returned an empty {type(data).__name__}, expected an iterable of (inputs, targets) batches"
        ) from None
    if not (isinstance(first, tuple | list) and len(first) == 2 and all(_movable(t) for t in first)):
        raise PluginError(
            f"--data {spec!r} returned a {type(data).__name__} whose first batch is {_kind(first)}, "
            "expected an (inputs, targets) pair of tensors (or of objects with a .to(device) method)"
        )
    if items is data and not hasattr(data, "seek"):
        return itertools.chain([first], items)
    return data


def _movable(item: Any) -> bool:
    """What the built-in loop can move to its device: a tensor, or a batch type of the model's own
    with ``.to(device, non_blocking=...)`` (the CTR example's ``CtrBatch``: dense features and ids)."""
    return isinstance(item, torch.Tensor) or (not isinstance(item, type) and callable(getattr(item, "to", None)))


def _kind(batch: Any) -> str:
    """A batch's shape of types for an error: "int", "a tuple of (Tensor, Tensor, Tensor)"."""
    if isinstance(batch, tuple | list) and len(batch) <= 4:
        return f"a {type(batch).__name__} of ({', '.join(type(x).__name__ for x in batch)})"
    if isinstance(batch, tuple | list):
        return f"a {type(batch).__name__} of {len(batch)} items"
    return type(batch).__name__


def check_specs(model: str, data: str, loss: str, *, num_workers: int = 1, own_loop: bool = False) -> None:
    """Fails with a PluginError naming the first bad spec, before a launcher starts any process.

    The model factory is called (its return type is the check), and the data factory for slot 0 of
    ``num_workers``, whose first batch is checked as the worker's built-in loop would read it (once
    here, so a bad return is one error before anything starts instead of every worker's exit 2).
    With ``own_loop`` (a ``--worker-script`` reads the data its own way) the data is only resolved.
    """
    load_model(model)
    if own_loop:
        resolve_callable(data, "data")
    else:
        checked_batches(data, load_data(data, 0, num_workers))
    load_loss(loss)
