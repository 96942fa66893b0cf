"""Private torch internals: the agent's request callback, narrowed to the message types rpcps sends.

A peer that reaches torch's TensorPipe agent chooses the *type* of each request, and the stock
request callback runs whatever the type says: PYTHON_CALL goes through the restricted unpickler
(``pickling``), but SCRIPT_CALL and SCRIPT_REMOTE_CALL run builtin operators and TorchScript
functions from C++ registries Python never sees (``aten::save`` writes a file anywhere the process
may write, ``aten::from_file`` reads, creates and grows files), and RRef, distributed-autograd and
profiling messages drive C++ state rpcps does not use. rpcps calls Python functions only, so every
process builds torch's agent with the callback of ``native/request_filter.cpp``, which lets through
only ``ACCEPTED_TYPES`` and answers any other request with an error before deserialising it.

How it gets in: torch's TensorPipe backend handler constructs the agent with ``from . import
TensorPipeAgent`` at call time. ``filtered_agents`` points that name at ``make_agent`` of the
native module for the duration of ``init_rpc``; ``require_filtered`` then checks the running agent
is one the native module built, so a torch that changed its handler fails the join instead of
running unfiltered. The native module is compiled by ``native/build.py`` (``tools/setup.sh``);
a process never compiles it itself: a missing or stale build fails ``install`` with the command to run.

What must not live here: the unpickler's policy (``pickling``), which functions rpcps exposes
(``rpcps.rpc_policy``).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import logging
import threading
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch.distributed.rpc as _rpc
from torch.distributed.rpc import api as _rpc_api
from torch.distributed.rpc import backend_registry as _rpc_backends

from rpcps.transport import pickling
from rpcps.transport.native import build

logger = logging.getLogger(__name__)

ACCEPTED_TYPES: tuple[str, ...] = ("PYTHON_CALL",)
"""The request types an rpcps process serves. Measured: a server, two workers and the join, leave,
liveness, registration, push, pull and replication calls send PYTHON_CALL and nothing else (rpcps
passes a token, not an RRef, and never records autograd or profiles across RPC); the test
``test_hostile_builtin_ops.py`` pins that the server accepted only these while training."""

REFUSAL_KINDS = ("message_type",)
"""The ``rpcps_transport_refused_total`` kind of a request refused for its message type."""

_ATTRIBUTE = "TensorPipeAgent"
"""The name torch's backend handler imports from ``torch.distributed.rpc`` to build the agent."""


class FilterUnavailable(RuntimeError):
    """The native request filter is not built for this torch and Python, or its build does not load."""


class _Announcer:
    """Logs the first refusal of each message type at once, then one line per type per window.

    A peer that floods refused requests must not turn the log into the attack's amplifier: the
    keys are torch's type names plus one "other" for every undefined value, so a flood costs at
    most one line per key per window, with the count of what it left out.
    """

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, key: str, text: str, message_bytes: int) -> bool:
        """Returns whether it logged."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.window_s:
                self._left_out[key] = self._left_out.get(key, 0) + 1
                return False
            self._last[key] = now
            left_out = self._left_out.pop(key, 0)
        logger.warning(
            "refused a torch RPC %s request from a peer (%d bytes): this process accepts only %s; see docs/SECURITY.md%s",
            text, message_bytes, ", ".join(ACCEPTED_TYPES),
            f" ({left_out} more like it refused since the last line)" if left_out else "",
        )
        return True


_native: ModuleType | None = None
_allowed: tuple[int, ...] = ()
_defined: frozenset[str] = frozenset()
"""The request type names this torch defines (the log's keys; any other value is "other")."""
_on_refusal: Callable[[pickling.Refusal], None] | None = None
_announce = _Announcer()


def load() -> ModuleType:
    """The native module built for this torch, Python and source (loaded once per process).

    Raises:
        FilterUnavailable: not built, built for something else, or it does not load.
    """
    global _native
    if _native is not None:
        return _native
    path = build.library_path()
    if not path.exists():
        others = sorted(p.name for p in build.BUILD_ROOT.glob("*/") if (p / path.name).exists()) if build.BUILD_ROOT.exists() else []
        found = f" (found builds for: {', '.join(others)})" if others else ""
        raise FilterUnavailable(
            f"rpcps's RPC request filter is not built for torch {build.torch_identity()} and this source{found}: "
            f"run `{build.COMMAND}` (tools/setup.sh does it; it needs g++ and ninja)"
        )
    try:
        spec = importlib.util.spec_from_file_location(
            build.MODULE_NAME, path, loader=importlib.machinery.ExtensionFileLoader(build.MODULE_NAME, str(path))
        )
        assert spec is not None and spec.loader is not None  # a path with a loader always gives both
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as e:
        raise FilterUnavailable(f"rpcps's RPC request filter at {path} does not load ({e}): run `{build.COMMAND}`") from e
    if module.built_for != build.torch_identity() or module.source_digest != build.source_digest():
        raise FilterUnavailable(
            f"rpcps's RPC request filter at {path} was built for torch {module.built_for} (source {module.source_digest}), "
            f"this is torch {build.torch_identity()} (source {build.source_digest()}): run `{build.COMMAND}`"
        )
    _native = module
    return module


def type_values(names: tuple[str, ...], defined: dict[str, int]) -> tuple[int, ...]:
    """The values of the named request types in this torch (``defined``: name -> value).

    Raises:
        pickling.TorchInternalsChanged: a name this torch does not define as a request type.
    """
    missing = [name for name in names if name not in defined]
    if missing:
        raise pickling.TorchInternalsChanged(f"this torch defines no request message type {missing}: re-check ACCEPTED_TYPES")
    return tuple(defined[name] for name in names)


def _refused(type_value: int, name: str, message_bytes: int) -> None:
    """Called by the native callback with the GIL, on the agent thread that refused the request."""
    _announce(name if name in _defined else "other", name, message_bytes)
    if _on_refusal is not None:
        refusal = pickling.Refusal(
            kind=REFUSAL_KINDS[0], module="torch.distributed.rpc.MessageType", name=name,
            message_bytes=message_bytes, thread=threading.current_thread().name,
        )
        try:
            _on_refusal(refusal)
        except Exception:  # a broken callback must not turn a refusal into a pass (it cannot: C++ refuses anyway)
            logger.exception("on_refusal callback failed")


def _check_torch_internals() -> None:
    handler = _rpc_backends._tensorpipe_init_backend_handler
    if _ATTRIBUTE not in handler.__code__.co_names or not hasattr(_rpc, _ATTRIBUTE):
        raise pickling.TorchInternalsChanged(
            "torch's TensorPipe backend handler no longer builds its agent from torch.distributed.rpc.TensorPipeAgent: "
            "the request filter cannot be put in"
        )


def install(on_refusal: Callable[[pickling.Refusal], None] | None = None) -> None:
    """Makes every agent this process builds in ``filtered_agents`` accept only ``ACCEPTED_TYPES``.

    Call before joining (``protection.protect`` does). A second call replaces ``on_refusal``.

    Raises:
        FilterUnavailable: the native module is missing, stale or does not load.
        pickling.TorchInternalsChanged: torch no longer looks like what this module hooks.
    """
    global _allowed, _defined, _on_refusal
    native = load()
    _check_torch_internals()
    defined = dict(native.request_types())
    _allowed, _defined = type_values(ACCEPTED_TYPES, defined), frozenset(defined)
    _on_refusal = on_refusal
    native.set_refusal_hook(_refused)


def installed() -> bool:
    return _native is not None and bool(_allowed)


def _filtered_agent(*args: Any, **kwargs: Any) -> Any:
    """Stands in for the ``TensorPipeAgent`` constructor: same arguments, the filtering callback."""
    assert _native is not None  # filtered_agents checks installed() first
    return _native.make_agent(*args, **kwargs, allowed_types=list(_allowed))


@contextlib.contextmanager
def filtered_agents() -> Iterator[None]:
    """While open, torch's ``init_rpc`` builds its agent with the request filter.

    Raises:
        FilterUnavailable: ``install`` has not run.
    """
    if not installed():
        raise FilterUnavailable("the RPC request filter is not installed: call rpcps.transport.protect(...) first")
    saved = getattr(_rpc, _ATTRIBUTE)
    setattr(_rpc, _ATTRIBUTE, _filtered_agent)
    try:
        yield
    finally:
        setattr(_rpc, _ATTRIBUTE, saved)


def require_filtered() -> None:
    """Raises FilterUnavailable unless this process's running agent filters its requests."""
    agent = _rpc_api._get_current_rpc_agent()
    if _native is None or not _native.is_filtered(agent):
        raise FilterUnavailable("the running RPC agent was not built with rpcps's request filter (did torch change how it builds agents?)")


def accepted_counts() -> dict[str, int]:
    """Requests let through since start, by message type (every agent of this process)."""
    return dict(_native.accepted_counts()) if _native is not None else {}


def refused_counts() -> dict[str, int]:
    """Requests refused since start, by message type."""
    return dict(_native.refused_counts()) if _native is not None else {}
