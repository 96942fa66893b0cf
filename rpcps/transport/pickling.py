"""Private torch RPC internals: the unpickler every incoming Python payload goes through.

torch RPC unpickles every incoming Python call (``rpc_sync``/``rpc_async``/``remote`` of a Python
function) and every Python reply with a plain ``pickle.Unpickler``: any peer that reaches the agent
could make this process run any importable function (``os.system``, ``eval``...), and any peer this
process calls could do the same through its reply. Here torch's unpickler is swapped for one that
builds only what rpcps itself sends, by construction rather than by a filter on names:

* **Names resolve to handles, never to the objects.** ``find_class`` answers a listed
  ``(module, name)`` with an immutable stand-in (``_Handle``, a tuple subclass without
  ``__dict__``), not with the class or function. pickle's mutating opcodes (BUILD, which sets
  attributes or calls ``__setstate__``; SETITEM(S); APPEND(S); ADDITEMS) find nothing to change on a
  handle: each of those entry points refuses. So no payload can rebind an attribute of an allowed
  class, function or module (issue 24: one BUILD rebinding ``_InternalRPCPickler._tensor_receiver``
  replaced every later push's gradients). NEWOBJ needs a real class and therefore always fails.
* **Two kinds of handle.** A *value* (a record, an enum, an exception class, torch's
  ``PythonUDF``/``RemoteException``/``WorkerInfo``/``device``) may be called while the payload loads
  and returns a fresh object, or a shared one that refuses ``__setstate__`` (enum members:
  ``rpcps.wire_records``). A *call* (an endpoint) runs only once the load has finished, when torch runs
  ``PythonUDF.func``: a payload cannot run an endpoint while it loads and then change its result.
* **The senders speak that format**: ``register_wire_reducers`` makes torch's pickler send
  ``PythonUDF``, ``RemoteException`` and ``WorkerInfo`` as constructor calls (plain pickle would use
  NEWOBJ and BUILD); rpcps records reduce to constructor calls themselves (``rpcps.messages``).

What torch needs from this hook, checked by ``install`` every time it runs:

* C++ (``PythonRpcHandler::init``) caches the *function* ``torch.distributed.rpc.internal.deserialize``
  once, so replacing that function does nothing; it reads the module global ``_unpickler`` on every
  call, for requests and replies alike, in every thread. Replacing that global is what works.
* Tensors and RRefs travel as ``getattr(_InternalRPCPickler, "_tensor_receiver")(index)`` and
  ``getattr(_InternalRPCPickler, "_py_rref_receiver")(fork_data)``, so ``builtins.getattr`` has to
  resolve; it resolves to ``_receiver_getattr``, which returns only those two (as handles).
  ``_script_module_receiver`` (``torch.jit.load`` of peer bytes) is deliberately not one of them.
* A refusal raises ``RefusedPayload``, an ``UnpicklingError``: torch's ``deserialize`` turns an
  ``AttributeError`` into a *value* (a reply would then look like the remote function's result), so
  every other failure inside a load is turned into a refusal too.
* torch restores its thread-local tensor table only after a successful load; a refusal drops it,
  or the refused message's tensors would stay pinned to that thread.

Not covered here: messages that are not pickled Python (builtin operators, TorchScript calls: the
agent's request filter refuses those before they are decoded); message size is checked here, after
the agent has already allocated the message.

What must not live here: which rpcps functions exist (``rpcps.rpc_policy`` passes the list).
"""

from __future__ import annotations

import copyreg
import dataclasses
import io
import logging
import operator
import pickle
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch.distributed.rpc import _utils as _rpc_utils
from torch.distributed.rpc import backend_registry as _rpc_backends
from torch.distributed.rpc import internal as _rpc_internal

from rpcps.logsafe import peer_text
from rpcps.wire_records import StateRefused

logger = logging.getLogger(__name__)

GlobalName = tuple[str, str]
"""A pickled global as the unpickler sees it: (module, qualified name)."""

RECEIVERS: frozenset[str] = frozenset({"_tensor_receiver", "_py_rref_receiver"})
"""The ``_InternalRPCPickler`` class methods torch's own pickler emits for tensors and RRefs."""

_GETATTR: GlobalName = ("builtins", "getattr")
_PICKLER: GlobalName = ("torch.distributed.rpc.internal", "_InternalRPCPickler")

EXCEPTION_TYPES: tuple[type[BaseException], ...] = (
    Exception, RuntimeError, ValueError, TypeError, KeyError, IndexError, LookupError, AttributeError,
    AssertionError, NotImplementedError, TimeoutError, ZeroDivisionError, OverflowError, OSError, MemoryError,
    PermissionError, StopIteration,
)
"""Exception classes a remote error may carry back. torch re-raises one by calling
``exception_type(message)`` on the caller (internal.py ``_handle_exception``), so only classes whose
constructor just stores the message belong here; an unlisted type is refused like any other global
and the caller gets the refusal instead of the error."""

REFUSAL_KINDS = ("global", "getattr", "size", "copyreg", "mutation", "call", "malformed")
"""Why a payload was refused (a metric label): an unlisted global (also a name this process lacks:
version skew), a getattr that is not a listed receiver, an oversized message, a copyreg
extension code resolved somewhere in this process (those bypass ``find_class``), an opcode that
would change an existing object (BUILD/SETITEM/APPEND/ADDITEMS on a handle or a shared value), an
endpoint called while the payload loads, or anything else the unpickler could not build (NEWOBJ of
a handle, a truncated or garbled stream)."""


@dataclass(frozen=True)
class Refusal:
    """One refused payload, as handed to ``on_refusal``."""

    kind: str
    """One of ``REFUSAL_KINDS``."""
    module: str
    name: str
    """Peer-supplied text (what the payload named): escape it before it reaches a log."""
    message_bytes: int
    """Pickled payload plus tensor bytes of the refused message (-1 when unknown)."""
    thread: str
    """The thread that unpickled it: an agent thread for a request, the one that completed the
    reply's future for a reply (both show as 'Dummy-N': C++ threads)."""

    def describe(self) -> str:
        """One line, safe to log: the peer-supplied names escaped (a newline cannot forge a line)."""
        if self.kind == "size":
            return f"size {self.message_bytes} bytes"
        return f"{self.kind} {peer_text(f'{self.module}.{self.name}')}"


class RefusedPayload(pickle.UnpicklingError):
    """Raised inside torch's deserialize; torch sends its text back to the caller as a RuntimeError."""


class TorchInternalsChanged(RuntimeError):
    """torch no longer looks like what this module hooks; installing would be inert or break RPC."""


@dataclass(frozen=True, kw_only=True)
class UnpicklePolicy:
    calls: Mapping[GlobalName, Callable[..., Any]]
    """Functions a peer may name as the call to run (``PythonUDF.func``), each with what runs for it
    (the function itself, or a guarded stand-in). Never callable while a payload loads."""
    values: Mapping[GlobalName, Callable[..., Any]]
    """What a payload may build while it loads: records, enums, exception classes, torch plumbing.
    Calling one must return a fresh object, or a shared one whose ``__setstate__`` refuses (``rpcps.wire_records``)."""
    max_message_bytes: int | None = None
    """Refuse a message whose pickled payload plus tensors exceed this, before anything in it runs
    (the agent has allocated it by then: this bounds what runs, not what arrives)."""
    on_refusal: Callable[[Refusal], None] | None = None
    """Called on the unpickling thread, with the GIL held, before the refusal is raised: count
    here. It must not block or make RPCs (it holds one of the agent's threads)."""

    def __post_init__(self) -> None:
        names = [*self.calls, *self.values]
        bad = [g for g in names if not (isinstance(g, tuple) and len(g) == 2 and all(isinstance(p, str) and p for p in g))]
        if bad:
            raise ValueError(f"calls and values must be keyed by (module, name) pairs of non-empty strings, got {bad[:3]}")
        both = set(self.calls) & set(self.values)
        if both:
            raise ValueError(f"a global is either a call or a value, not both: {sorted(both)[:3]}")
        reserved = {_GETATTR, _PICKLER} & set(names)
        if reserved:
            raise ValueError(f"{sorted(reserved)} are torch's receivers' plumbing, resolved by this module itself")
        if self.max_message_bytes is not None and self.max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be >= 1 or None, got {self.max_message_bytes}")

    @property
    def allowed(self) -> frozenset[GlobalName]:
        """Every (module, name) a payload may name."""
        return frozenset(self.calls) | frozenset(self.values) | {_GETATTR, _PICKLER}


def _lookup(module: str, qualname: str) -> Any:
    __import__(module)
    obj: Any = sys.modules[module]
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def named(*objects: Any) -> dict[GlobalName, Any]:
    """The globals pickle writes for these functions and classes, checked to resolve back to them.

    Raises:
        ValueError: for an object pickle cannot name (a lambda, a nested or local function).
    """
    out = {}
    for obj in objects:
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if not module or not qualname or "<" in qualname:
            raise ValueError(f"{obj!r} has no importable name; only module-level functions and classes can be listed")
        if _lookup(module, qualname) is not obj:
            raise ValueError(f"{module}.{qualname} does not resolve back to {obj!r}")
        out[(module, qualname)] = obj
    return out


def names_of(*objects: Any) -> frozenset[GlobalName]:
    """The globals pickle writes for these objects (``named`` without the objects)."""
    return frozenset(named(*objects))


TORCH_VALUES: dict[GlobalName, Any] = named(
    _rpc_internal.PythonUDF,  # every Python call: PythonUDF(func, args, kwargs)
    _rpc_internal.RemoteException,  # every error a remote function raised
)
"""What torch's RPC plumbing builds on every message, whatever the application sends."""

JOIN_HANDSHAKE_VALUES: dict[GlobalName, Any] = named(torch._C._distributed_rpc.WorkerInfo, torch.device)
JOIN_HANDSHAKE_CALLS: dict[GlobalName, Any] = named(_rpc_backends._get_device_infos, _rpc_utils._update_group_membership)
"""A process joining a dynamic group (init_rpc with world_size=None) calls these on every member.
The second lets a peer add or remove members of this agent's view, so ``rpcps.transport.protection``
hands out a guarded stand-in for it."""
UPDATE_GROUP_MEMBERSHIP: GlobalName = next(iter(names_of(_rpc_utils._update_group_membership)))


# ---- what the senders send: constructor calls, never NEWOBJ or BUILD ----------------------------


def _reduce_python_udf(udf: Any) -> tuple[Any, tuple[Any, ...]]:
    return _rpc_internal.PythonUDF, (udf.func, udf.args, udf.kwargs)


def _reduce_remote_exception(error: Any) -> tuple[Any, tuple[Any, ...]]:
    return _rpc_internal.RemoteException, (error.msg, error.exception_type)


def _reduce_worker_info(info: Any) -> tuple[Any, tuple[Any, ...]]:
    return torch._C._distributed_rpc.WorkerInfo, (info.name, info.id)


def register_wire_reducers() -> None:
    """Makes torch's RPC pickler in this process send its own records as constructor calls.

    What every rpcps process sends (``install`` does it); a process that only talks to rpcps
    processes without being one (a test's stranger) calls it to speak the same format.
    """
    pickler = _rpc_internal._internal_rpc_pickler
    pickler._register_reducer(_rpc_internal.PythonUDF, _reduce_python_udf)
    pickler._register_reducer(_rpc_internal.RemoteException, _reduce_remote_exception)
    pickler._register_reducer(torch._C._distributed_rpc.WorkerInfo, _reduce_worker_info)


# ---- the handles a payload sees --------------------------------------------------------------------


# The policy in force and its handles, read on every load, so ``install`` swaps them for every
# thread at once.
_policy: UnpicklePolicy | None = None
_handles: dict[GlobalName, _Handle] = {}
_policy_lock = threading.Lock()
_loading = threading.local()
"""``active`` is True on a thread while it unpickles a payload (calls are refused then)."""
_announce = True
"""False only while ``_self_test`` provokes its own refusals (not news, not a metric)."""


class _Handle(tuple):
    """An allowed global as a payload sees it: ``(target, module, name)``, immutable.

    A tuple subclass with no ``__dict__`` and no settable attribute; every method a mutating pickle
    opcode looks up refuses, so BUILD, SETITEM(S), APPEND(S) and ADDITEMS on a handle are refused
    (and nothing else in a payload reaches the target to change it).
    """

    __slots__ = ()

    def _mutation(self, *_args: Any, **_kwargs: Any) -> NoReturn:
        raise _refuse("mutation", self[1], self[2], -1)

    __setstate__ = _mutation
    __setitem__ = _mutation
    __delitem__ = _mutation
    append = _mutation
    extend = _mutation
    add = _mutation

    def __repr__(self) -> str:
        return f"<rpc {type(self).__name__.strip('_').lower()} {self[1]}.{self[2]}>"


class _Value(_Handle):
    """Something a payload may build while it loads (a record, an enum, an exception class)."""

    __slots__ = ()

    # Calling a handle calls its target with no Python frame in between: the call slot looks
    # ``__call__`` up, this C getter returns the target, and the target is called. A message with
    # ten tensors makes ten such calls (the tensor receiver), so a frame each would show.
    __call__ = property(operator.itemgetter(0))


class _Call(_Handle):
    """A function a peer may ask this process to run: torch runs it once the payload has loaded."""

    __slots__ = ()

    @property
    def target(self) -> Callable[..., Any]:
        return self[0]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(_loading, "active", False):
            raise _refuse("call", self[1], self[2], -1)
        return self[0](*args, **kwargs)


class _Opaque(_Handle):
    """A name a payload may mention but not call: the owner of torch's receivers."""

    __slots__ = ()


def _handle(kind: type[_Handle], name: GlobalName, target: Any) -> _Handle:
    return kind((target, *name))


_PICKLER_HANDLE = _handle(_Opaque, _PICKLER, _rpc_internal._InternalRPCPickler)
_RECEIVER_HANDLES = {
    name: _handle(_Value, (_PICKLER[0], f"{_PICKLER[1]}.{name}"), getattr(_rpc_internal._InternalRPCPickler, name))
    for name in RECEIVERS
}


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
    policy = _policy
    refusal = Refusal(kind=kind, module=str(module), name=str(name), message_bytes=size, thread=threading.current_thread().name)
    # torch restores the thread's tensor table only after a successful load: left here, it would
    # pin the refused message's tensors to this thread until the next refusal on it.
    try:
        del _rpc_internal._thread_local_tensor_tables.recv_tables
    except AttributeError:
        pass
    if _announce:
        _log_refusal(refusal)
        if policy is not None and policy.on_refusal is not None:
            try:
                policy.on_refusal(refusal)
            except Exception:  # a broken callback must not turn a refusal into a pass
                logger.exception("on_refusal callback failed")
    return RefusedPayload(f"rpc payload refused ({refusal.describe()}): not allowed by this process")


def _receiver_getattr(obj: Any, name: str, *default: Any) -> Any:
    """Stands in for ``builtins.getattr``: only ``_InternalRPCPickler.<listed receiver>``, as a handle."""
    if obj is _PICKLER_HANDLE and name in RECEIVERS and not default:
        return _RECEIVER_HANDLES[name]
    owner = obj[2] if isinstance(obj, _Handle) else type(obj).__qualname__
    raise _refuse("getattr", str(owner), str(name), -1)


_GETATTR_HANDLE = _handle(_Value, _GETATTR, _receiver_getattr)


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
        _loading.active = True
        try:
            return super().load()
        except RefusedPayload:
            raise
        except StateRefused as e:  # BUILD on a record or an enum member (rpcps.wire_records)
            module, _, name = str(e).rpartition(".")
            raise _refuse("mutation", module, name, _payload_bytes(self._file)) from None
        except Exception as e:  # noqa: BLE001 - any failure is a refusal: torch would return an AttributeError as the value
            raise _refuse("malformed", type(e).__name__, str(e)[:200], _payload_bytes(self._file)) from None
        finally:
            _loading.active = False

    def find_class(self, module: str, name: str) -> Any:
        # Also reached for copyreg extension codes not yet in copyreg's cache (load() refuses while
        # that cache is non-empty). persistent_load is not defined, so PERSID fails.
        handle = _handles.get((module, name))
        if handle is None:
            raise _refuse("global", module, name, _payload_bytes(self._file))
        return handle


def _require(condition: bool, message: str) -> None:
    # Not `assert`: python -O strips asserts, and this check guards a security boundary.
    if not condition:
        raise TorchInternalsChanged(message)


def _check_torch_internals() -> None:
    """Fails loudly when the torch internals this module relies on have changed."""
    pickler_cls: Any = getattr(_rpc_internal, "_InternalRPCPickler", None)
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
    _require(callable(getattr(pickler_cls, "_register_reducer", None)), "_InternalRPCPickler._register_reducer is gone")
    _require(hasattr(_rpc_internal, "_thread_local_tensor_tables"), "torch's RPC tensor tables moved")
    for receiver in RECEIVERS:
        _require(callable(getattr(pickler_cls, receiver, None)), f"_InternalRPCPickler.{receiver} is gone")
    _require(not copyreg._extension_cache, "copyreg extension codes were resolved in this process; they bypass find_class")  # type: ignore[attr-defined]


def _build_handles(policy: UnpicklePolicy) -> dict[GlobalName, _Handle]:
    handles: dict[GlobalName, _Handle] = {_GETATTR: _GETATTR_HANDLE, _PICKLER: _PICKLER_HANDLE}
    handles.update({name: _handle(_Value, name, target) for name, target in policy.values.items()})
    handles.update({name: _handle(_Call, name, target) for name, target in policy.calls.items()})
    return handles


def _use(policy: UnpicklePolicy | None) -> None:
    global _policy, _handles
    with _policy_lock:
        _policy, _handles = policy, (_build_handles(policy) if policy is not None else {})


def _self_test() -> None:
    """Round-trips what torch really emits for a call with tensors through the installed hook.

    Catches a torch that starts pickling tensors or PythonUDF under other names (the allow-list
    would then refuse all traffic), and proves the refusal paths are reachable: an unlisted global,
    and a BUILD on an allowed name.
    """
    global _announce
    sample = _rpc_internal.PythonUDF(print, ((torch.zeros(2), torch.zeros(1, dtype=torch.bfloat16)),), {})
    payload, tensors = _rpc_internal.serialize(sample)
    evil, _ = _rpc_internal.serialize(_rpc_internal.PythonUDF(repr, (), {}))
    # PythonUDF, then BUILD on it: what issue 24's gadget did to rebind a class attribute.
    build = pickle.PROTO + b"\x04" + pickle.GLOBAL + b"torch.distributed.rpc.internal\nPythonUDF\n" + (
        pickle.NONE + pickle.EMPTY_DICT + pickle.SHORT_BINUNICODE + b"\x04func" + pickle.NONE + pickle.SETITEM
        + pickle.TUPLE2 + pickle.BUILD + pickle.STOP
    )
    saved = _policy
    _use(UnpicklePolicy(calls=named(print), values=TORCH_VALUES))
    try:
        out = _rpc_internal.deserialize(payload, tensors)
        _require(
            isinstance(out, _rpc_internal.PythonUDF) and out.args[0][0] is tensors[0] and out.func.target is print,
            f"torch's RPC pickle format changed: a tensor call came back as {out!r}",
        )
        _announce = False
        for payload_bytes, what in ((evil, "an unlisted builtins.repr"), (build, "a BUILD on PythonUDF")):
            try:
                _rpc_internal.deserialize(payload_bytes, [])
            except RefusedPayload:
                continue
            raise TorchInternalsChanged(f"the restricted unpickler did not refuse {what}: the hook is inert")
        _require(_rpc_internal.PythonUDF.__dict__.get("func") is not None, "the self test changed PythonUDF")
    finally:
        _announce = True
        _use(saved)


def install(policy: UnpicklePolicy) -> None:
    """Makes every Python RPC payload this process receives go through ``policy``.

    Call it before ``init_rpc`` (``rpcps.transport`` refuses to join without it). A second call
    replaces the policy. If the self test fails, the hook stays in place with no policy: every
    payload is refused (fails closed).

    Raises:
        TorchInternalsChanged: torch's internals no longer look like what this module hooks.
        ValueError: the policy lacks what every torch RPC payload needs.
    """
    missing = set(TORCH_VALUES) - set(policy.values)
    if missing:
        raise ValueError(f"policy.values lacks {sorted(missing)}: every RPC payload would be refused")
    _check_torch_internals()
    register_wire_reducers()
    with _policy_lock:
        _rpc_internal._unpickler = RestrictedUnpickler
    _use(None)
    _self_test()
    _use(policy)
    logger.debug("restricted RPC unpickler installed: %d allowed globals", len(_handles))


def set_max_message_bytes(limit: int | None) -> None:
    """Changes the size limit of the installed policy (a worker learns its model after joining)."""
    policy = _policy
    if policy is None:
        raise RuntimeError("no RPC unpickle policy is installed")
    _use(dataclasses.replace(policy, max_message_bytes=limit))


def installed() -> bool:
    return _policy is not None and _rpc_internal._unpickler is RestrictedUnpickler


def uninstall() -> None:
    """Restores torch's plain unpickler (tests only: production processes never go back)."""
    _rpc_internal._unpickler = pickle.Unpickler
    _use(None)


def merged(*parts: Mapping[GlobalName, Any]) -> dict[GlobalName, Any]:
    """The union of ``named`` maps: ``merged(TORCH_VALUES, named(A, B), ...)``."""
    out: dict[GlobalName, Any] = {}
    for part in parts:
        out.update(part)
    return out


def unwrap(obj: Any) -> Any:
    """What a handle stands for (tests and diagnostics; a payload never gets this)."""
    return obj[0] if isinstance(obj, _Handle) else obj

