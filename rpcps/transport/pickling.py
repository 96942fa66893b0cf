"""Private torch RPC internals: the allow-list unpickler every incoming Python payload goes through.

torch RPC unpickles every incoming Python call (``rpc_sync``/``rpc_async``/``remote`` of a Python
function) and every Python reply with a plain ``pickle.Unpickler``: any peer that reaches the agent
could make this process run any importable function (``os.system``, ``eval``...), and any peer this
process calls could do the same through its reply. Here torch's unpickler is swapped for one that
resolves only listed ``(module, name)`` globals and refuses everything else before any of the
payload runs. The research behind each choice is in the ``scratch-unpickler`` findings
(docs/SECURITY.md summarises them); ``tests/integration/test_hostile_peers.py`` pins it with real
processes, and ``install`` checks the internals it relies on every time it runs:

* C++ (``PythonRpcHandler::init``) caches the *function* ``torch.distributed.rpc.internal.deserialize``
  once, so replacing that function does nothing; it reads the module global ``_unpickler`` on every
  call, for requests and replies alike, in every thread. Replacing that global is what works.
* Tensors and RRefs travel as ``getattr(_InternalRPCPickler, "_tensor_receiver")(index)`` and
  ``getattr(_InternalRPCPickler, "_py_rref_receiver")(fork_data)``, so ``builtins.getattr`` has to
  resolve; the real one would hand a peer every attribute of everything listed (``__globals__``,
  from there ``sys.modules``), so it resolves to ``_receiver_getattr``, which returns only those two.
  ``_script_module_receiver`` (``torch.jit.load`` of peer bytes) is deliberately not one of them.
* A refusal raises ``RefusedPayload``, an ``UnpicklingError``: torch's ``deserialize`` turns an
  ``AttributeError`` into a *value* (a reply would then look like the remote function's result).
* torch restores its thread-local tensor table only after a successful load; a refusal drops it,
  or the refused message's tensors would stay pinned to that thread.

Not covered (docs/SECURITY.md): builtin operators and TorchScript calls never reach Python
(``builtin_ops`` denies the one known file primitive); message size is checked here, after the
agent has already allocated the message.

What must not live here: which rpcps functions exist (``rpcps.rpc_policy`` passes the list).
"""

from __future__ import annotations

import copyreg
import dataclasses
import io
import logging
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.rpc import _utils as _rpc_utils
from torch.distributed.rpc import backend_registry as _rpc_backends
from torch.distributed.rpc import internal as _rpc_internal

logger = logging.getLogger(__name__)

GlobalName = tuple[str, str]
"""A pickled global as the unpickler sees it: (module, qualified name)."""

RECEIVERS: frozenset[str] = frozenset({"_tensor_receiver", "_py_rref_receiver"})
"""The ``_InternalRPCPickler`` class methods torch's own pickler emits for tensors and RRefs."""

_GETATTR: GlobalName = ("builtins", "getattr")

EXCEPTION_TYPES: tuple[type[BaseException], ...] = (
    Exception, RuntimeError, ValueError, TypeError, KeyError, IndexError, LookupError, AttributeError,
    AssertionError, NotImplementedError, TimeoutError, ZeroDivisionError, OverflowError, OSError, MemoryError,
    PermissionError, StopIteration,
)
"""Exception classes a remote error may carry back. torch re-raises one by calling
``exception_type(message)`` on the caller (internal.py ``_handle_exception``), so only classes whose
constructor just stores the message belong here; an unlisted type is refused like any other global
and the caller gets the refusal instead of the error."""

REFUSAL_KINDS = ("global", "getattr", "missing", "size", "copyreg")
"""Why a payload was refused (a metric label): an unlisted global, a getattr that is not a listed
receiver, a listed name that does not resolve here (version skew), an oversized message, or a
copyreg extension code resolved somewhere in this process (those bypass ``find_class``)."""


@dataclass(frozen=True)
class Refusal:
    """One refused payload, as handed to ``on_refusal``."""

    kind: str
    """One of ``REFUSAL_KINDS``."""
    module: str
    name: str
    message_bytes: int
    """Pickled payload plus tensor bytes of the refused message (-1 when unknown)."""
    thread: str
    """The thread that unpickled it: an agent thread for a request, the one that completed the
    reply's future for a reply (both show as 'Dummy-N': C++ threads)."""

    def describe(self) -> str:
        what = f"{self.message_bytes} bytes" if self.kind == "size" else f"{self.module}.{self.name}"
        return f"{self.kind} {what}"


class RefusedPayload(pickle.UnpicklingError):
    """Raised inside torch's deserialize; torch sends its text back to the caller as a RuntimeError."""


class TorchInternalsChanged(RuntimeError):
    """torch no longer looks like what this module hooks; installing would be inert or break RPC."""


@dataclass(frozen=True, kw_only=True)
class UnpicklePolicy:
    allowed: frozenset[GlobalName]
    """Every (module, qualified name) a peer may name. Built from function and class objects
    (``names_of``), never from strings, so a moved function cannot silently refuse traffic."""
    overrides: Mapping[GlobalName, Any] = field(default_factory=dict)
    """Objects handed out instead of the real one for an allowed name (a guarded wrapper)."""
    max_message_bytes: int | None = None
    """Refuse a message whose pickled payload plus tensors exceed this, before anything in it runs
    (the agent has allocated it by then: this bounds what runs, not what arrives)."""
    on_refusal: Callable[[Refusal], None] | None = None
    """Called on the unpickling thread, with the GIL held, before the refusal is raised: count
    here. It must not block or make RPCs (it holds one of the agent's threads)."""

    def __post_init__(self) -> None:
        bad = [g for g in self.allowed if not (isinstance(g, tuple) and len(g) == 2 and all(isinstance(p, str) and p for p in g))]
        if bad:
            raise ValueError(f"allowed must hold (module, name) pairs of non-empty strings, got {bad[:3]}")
        unknown = set(self.overrides) - self.allowed
        if unknown:
            raise ValueError(f"overrides names globals that allowed does not list: {sorted(unknown)}")
        if self.max_message_bytes is not None and self.max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be >= 1 or None, got {self.max_message_bytes}")


def _lookup(module: str, qualname: str) -> Any:
    __import__(module)
    obj: Any = sys.modules[module]
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def names_of(*objects: Any) -> frozenset[GlobalName]:
    """The globals pickle writes for these functions and classes, checked to resolve back to them.

    Raises:
        ValueError: for an object pickle cannot name (a lambda, a nested or local function).
    """
    names = set()
    for obj in objects:
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if not module or not qualname or "<" in qualname:
            raise ValueError(f"{obj!r} has no importable name; only module-level functions and classes can be listed")
        if _lookup(module, qualname) is not obj:
            raise ValueError(f"{module}.{qualname} does not resolve back to {obj!r}")
        names.add((module, qualname))
    return frozenset(names)


TORCH_PLUMBING: frozenset[GlobalName] = names_of(
    _rpc_internal.PythonUDF,  # every Python call: PythonUDF(func, args, kwargs)
    _rpc_internal.RemoteException,  # every error a remote function raised
    _rpc_internal._InternalRPCPickler,  # owner of the tensor and RRef receivers
) | {_GETATTR}  # resolved to _receiver_getattr, never to the real getattr
"""What torch's RPC plumbing pickles, whatever the application sends."""

JOIN_HANDSHAKE: frozenset[GlobalName] = names_of(
    # A process joining a dynamic group (init_rpc with world_size=None) calls these on every
    # member. Listing them lets a peer add or remove members of this agent's view, so the second
    # one is handed out guarded (``membership.guarded_update_group_membership``).
    _rpc_backends._get_device_infos,
    _rpc_utils._update_group_membership,
    torch._C._distributed_rpc.WorkerInfo,
    torch.device,
)
UPDATE_GROUP_MEMBERSHIP: GlobalName = next(iter(names_of(_rpc_utils._update_group_membership)))


# The policy in force, read on every load, so ``install`` swaps it for every thread at once.
_policy: UnpicklePolicy | None = None
_policy_lock = threading.Lock()
_refusals = 0
_announce = True
"""False only while ``_self_test`` provokes its own refusal (not news, not a metric)."""


class _LogLimit:
    """At most ``per_window`` refusal lines per window; then one line saying how many were left out.

    A peer that floods refused calls must not turn the server's log into the attack's amplifier.
    """

    def __init__(self, per_window: int = 10, window_s: float = 10.0) -> None:
        self.per_window, self.window_s = per_window, window_s
        self._start, self._logged, self._dropped = 0.0, 0, 0
        self._lock = threading.Lock()

    def __call__(self, refusal: Refusal) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._start >= self.window_s:
                if self._dropped:
                    logger.warning("... and %d more refused RPC payloads in the last %.0fs", self._dropped, now - self._start)
                self._start, self._logged, self._dropped = now, 0, 0
            if self._logged >= self.per_window:
                self._dropped += 1
                return
            self._logged += 1
        logger.warning(
            "refused an RPC payload from a peer: %s is not allowed in this process (thread %s); see docs/SECURITY.md",
            refusal.describe(), refusal.thread,
        )


_log_refusal = _LogLimit()


def _payload_bytes(file: Any) -> int:
    buffer = file.getbuffer() if isinstance(file, io.BytesIO) else b""
    tables = getattr(_rpc_internal._thread_local_tensor_tables, "recv_tables", None) or []
    return len(buffer) + sum(t.nelement() * t.element_size() for t in tables)


def _refuse(kind: str, module: str, name: str, size: int) -> RefusedPayload:
    global _refusals
    policy = _policy
    refusal = Refusal(kind=kind, module=module, name=name, message_bytes=size, thread=threading.current_thread().name)
    # torch restores the thread's tensor table only after a successful load: left here, it would
    # pin the refused message's tensors to this thread until the next refusal on it.
    try:
        del _rpc_internal._thread_local_tensor_tables.recv_tables
    except AttributeError:
        pass
    if _announce:
        with _policy_lock:
            _refusals += 1
        _log_refusal(refusal)
        if policy is not None and policy.on_refusal is not None:
            try:
                policy.on_refusal(refusal)
            except Exception:  # a broken callback must not turn a refusal into a pass
                logger.exception("on_refusal callback failed")
    return RefusedPayload(f"rpc payload refused ({refusal.describe()}): not allowed by this process")


def _receiver_getattr(obj: Any, name: str, *default: Any) -> Any:
    """Stands in for ``builtins.getattr``: only ``_InternalRPCPickler.<listed receiver>``."""
    if obj is _rpc_internal._InternalRPCPickler and name in RECEIVERS and not default:
        return getattr(obj, name)
    owner = getattr(obj, "__qualname__", type(obj).__qualname__)
    raise _refuse("getattr", str(owner), str(name), -1)


class RestrictedUnpickler(pickle.Unpickler):
    """The ``pickle.Unpickler`` torch constructs per message once ``install`` has run."""

    def __init__(self, file: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(file, *args, **kwargs)
        self._file = file

    def load(self) -> Any:
        policy = _policy
        if copyreg._extension_cache:  # type: ignore[attr-defined]
            # The C unpickler serves an EXT1/2/4 code from this cache without calling find_class.
            # Nothing registers extensions today; if something does, refuse everything, loudly.
            raise _refuse("copyreg", "copyreg", "_extension_cache", _payload_bytes(self._file))
        if policy is not None and policy.max_message_bytes is not None:
            size = _payload_bytes(self._file)
            if size > policy.max_message_bytes:
                raise _refuse("size", "", "", size)
        return super().load()

    def find_class(self, module: str, name: str) -> Any:
        # Also reached for copyreg extension codes not yet in copyreg's cache (load() refuses while
        # that cache is non-empty). persistent_load is not defined, so PERSID fails.
        policy = _policy
        key = (module, name)
        if policy is None or key not in policy.allowed:
            raise _refuse("global", module, name, _payload_bytes(self._file))
        if key == _GETATTR:
            return _receiver_getattr
        if key in policy.overrides:
            return policy.overrides[key]
        try:
            return _lookup(module, name)
        except (ImportError, AttributeError):
            raise _refuse("missing", module, name, _payload_bytes(self._file)) from None


def _require(condition: bool, message: str) -> None:
    # Not `assert`: python -O strips asserts, and this check guards a security boundary.
    if not condition:
        raise TorchInternalsChanged(message)


def _check_torch_internals() -> None:
    """Fails loudly when the torch internals this module relies on have changed."""
    pickler_cls = getattr(_rpc_internal, "_InternalRPCPickler", None)
    _require(pickler_cls is not None, "torch.distributed.rpc.internal._InternalRPCPickler is gone: re-check the hook")
    _require(
        _rpc_internal._unpickler in (pickle.Unpickler, RestrictedUnpickler),
        f"torch.distributed.rpc.internal._unpickler is {_rpc_internal._unpickler!r}, not pickle.Unpickler: "
        "someone else replaced it, or torch changed how it unpickles RPC payloads",
    )
    _require(
        "_unpickler" in pickler_cls.deserialize.__code__.co_names,
        "_InternalRPCPickler.deserialize no longer reads the module global _unpickler: the hook would be inert",
    )
    _require(
        isinstance(getattr(_rpc_internal, "_internal_rpc_pickler", None), pickler_cls),
        "torch.distributed.rpc.internal._internal_rpc_pickler is gone or of another type",
    )
    _require(hasattr(_rpc_internal, "_thread_local_tensor_tables"), "torch's RPC tensor tables moved")
    for receiver in RECEIVERS:
        _require(callable(getattr(pickler_cls, receiver, None)), f"_InternalRPCPickler.{receiver} is gone")
    _require(not copyreg._extension_cache, "copyreg extension codes were resolved in this process; they bypass find_class")  # type: ignore[attr-defined]


def _self_test() -> None:
    """Round-trips what torch really emits for a call with tensors through the installed hook.

    Catches a torch that starts pickling tensors or PythonUDF under other names (the allow-list
    would then refuse all traffic), and proves the refusal path is reachable.
    """
    global _policy, _announce
    sample = _rpc_internal.PythonUDF(torch.Size, ((torch.zeros(2), torch.zeros(1, dtype=torch.bfloat16)),), {})
    payload, tensors = _rpc_internal.serialize(sample)
    evil, _ = _rpc_internal.serialize(_rpc_internal.PythonUDF(print, (), {}))
    saved = _policy
    _policy = UnpicklePolicy(allowed=TORCH_PLUMBING | names_of(torch.Size))
    try:
        out = _rpc_internal.deserialize(payload, tensors)
        _require(
            isinstance(out, _rpc_internal.PythonUDF) and out.args[0][0] is tensors[0],
            f"torch's RPC pickle format changed: a tensor call came back as {out!r}",
        )
        _announce = False
        try:
            _rpc_internal.deserialize(evil, [])
        except RefusedPayload:
            pass
        else:
            raise TorchInternalsChanged("the restricted unpickler did not refuse builtins.print: the hook is inert")
    finally:
        _policy, _announce = saved, True


def install(policy: UnpicklePolicy) -> None:
    """Makes every Python RPC payload this process receives go through ``policy``.

    Call it before ``init_rpc`` (``rpcps.transport`` refuses to join without it). A second call
    replaces the policy. If the self test fails, the hook stays in place with no policy: every
    payload is refused (fails closed).

    Raises:
        TorchInternalsChanged: torch's internals no longer look like what this module hooks.
        ValueError: the policy lacks what every torch RPC payload needs.
    """
    global _policy
    missing = TORCH_PLUMBING - policy.allowed
    if missing:
        raise ValueError(f"policy.allowed lacks {sorted(missing)}: every RPC payload would be refused")
    _check_torch_internals()
    with _policy_lock:
        _policy = None
        _rpc_internal._unpickler = RestrictedUnpickler
    _self_test()
    _policy = policy
    logger.debug("restricted RPC unpickler installed: %d allowed globals", len(policy.allowed))


def set_max_message_bytes(limit: int | None) -> None:
    """Changes the size limit of the installed policy (a worker learns its model after joining)."""
    global _policy
    with _policy_lock:
        if _policy is None:
            raise RuntimeError("no RPC unpickle policy is installed")
        _policy = dataclasses.replace(_policy, max_message_bytes=limit)


def installed() -> bool:
    return _policy is not None and _rpc_internal._unpickler is RestrictedUnpickler


def uninstall() -> None:
    """Restores torch's plain unpickler (tests only: production processes never go back)."""
    global _policy
    _rpc_internal._unpickler = pickle.Unpickler
    _policy = None


def refusals_total() -> int:
    """Refusals since import (every kind)."""
    return _refusals


def allow_list(*parts: Iterable[GlobalName]) -> frozenset[GlobalName]:
    """The union of global sets: ``allow_list(TORCH_PLUMBING, names_of(f, g), ...)``."""
    out: set[GlobalName] = set()
    for part in parts:
        out |= set(part)
    return frozenset(out)
