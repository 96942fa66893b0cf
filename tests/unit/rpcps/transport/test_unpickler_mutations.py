"""The unpickler admits no opcode that changes an existing object (issue 24, first attack).

A payload of a few hundred bytes used pickle's BUILD to set attributes on an allowed class (torch's
``_InternalRPCPickler`` receivers, an enum member): every later push's gradients were replaced, or
training stopped. Here each gadget is refused and counted, and a property test fuzzes opcode
sequences over every name a server allows and checks that no allowed class, function, enum member
or module attribute changed. The same over real processes: tests/integration/security/test_hostile_peers.py.
"""

from __future__ import annotations

import enum
import pickle
import pickletools
import struct
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.rpc import internal

from rpcps import endpoints, replica_endpoints, rpc_policy
from rpcps.messages import PushReply, PushStatus, View
from rpcps.transport import pickling, protection


@pytest.fixture
def refusals() -> Iterator[list[pickling.Refusal]]:
    seen: list[pickling.Refusal] = []
    rpc_policy.protect(on_refusal=seen.append, extra_calls=replica_endpoints.SERVER_ENDPOINTS)
    yield seen
    pickling.uninstall()


def _unicode(text: str) -> bytes:
    data = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data


def _global(module: str, name: str) -> bytes:
    return _unicode(module) + _unicode(name) + pickle.STACK_GLOBAL


def _load(body: bytes, tensors: list[torch.Tensor] | None = None) -> Any:
    return internal.deserialize(pickle.PROTO + b"\x04" + body + pickle.STOP, tensors or [])


def _slot_state(**attributes: bytes) -> bytes:
    """(None, {name: value, ...}): BUILD's 'slot state', set with setattr on the object below it."""
    items = b"".join(_unicode(k) + v for k, v in attributes.items())
    return pickle.NONE + pickle.EMPTY_DICT + pickle.MARK + items + pickle.SETITEMS + pickle.TUPLE2


def test_build_on_torch_s_pickler_class_is_refused_and_changes_nothing(refusals: list[pickling.Refusal]) -> None:
    """The gadget of the review: rebind the tensor receiver so every later tensor is the attacker's."""
    receiver = internal._InternalRPCPickler.__dict__["_tensor_receiver"]
    gadget = _global("torch.distributed.rpc.internal", "_InternalRPCPickler") + _slot_state(
        _tensor_receiver=_global("builtins", "getattr")
    ) + pickle.BUILD
    with pytest.raises(pickling.RefusedPayload, match="mutation"):
        _load(gadget)
    assert internal._InternalRPCPickler.__dict__["_tensor_receiver"] is receiver
    assert [r.kind for r in refusals] == ["mutation"]


def test_build_on_an_enum_member_is_refused(refusals: list[pickling.Refusal]) -> None:
    """The second gadget: a shared member's value rewritten, and the worker exits on an invalid status."""
    member = _global("rpcps.messages", "PushStatus") + _unicode("applied") + pickle.TUPLE1 + pickle.REDUCE
    with pytest.raises(pickling.RefusedPayload, match="mutation"):
        _load(member + pickle.EMPTY_DICT + _unicode("_value_") + _unicode("evil") + pickle.SETITEM + pickle.BUILD)
    assert PushStatus.APPLIED.value == "applied" and PushStatus("applied") is PushStatus.APPLIED
    assert refusals[0].kind == "mutation"


@pytest.mark.parametrize(
    "gadget",
    [
        _global("rpcps.messages", "View") + _slot_state(__init__=pickle.NONE) + pickle.BUILD,
        _global("rpcps.endpoints", "register") + _slot_state(__defaults__=pickle.EMPTY_TUPLE) + pickle.BUILD,
        _global("rpcps.endpoints", "pull") + pickle.NONE + pickle.NONE + pickle.SETITEM,
        _global("rpcps.endpoints", "pull") + pickle.NONE + pickle.APPEND,
        _global("rpcps.endpoints", "pull") + pickle.MARK + pickle.NONE + pickle.APPENDS,
        _global("rpcps.endpoints", "pull") + pickle.MARK + pickle.NONE + pickle.ADDITEMS,
        # A record built, then its state set (records reduce to constructor calls: no BUILD at all).
        _global("rpcps.messages", "View") + pickle.BININT1 + b"\x01" + _unicode("a") + pickle.TUPLE2 + pickle.REDUCE
        + pickle.EMPTY_DICT + pickle.BUILD,
    ],
    ids=["build-record-class", "build-endpoint", "setitem", "append", "appends", "additems", "build-record"],
)
def test_every_mutating_opcode_on_an_allowed_name_is_refused(refusals: list[pickling.Refusal], gadget: bytes) -> None:
    defaults, init = endpoints.register.__defaults__, View.__init__
    with pytest.raises(pickling.RefusedPayload, match="mutation"):
        _load(gadget)
    assert endpoints.register.__defaults__ == defaults and View.__init__ is init
    assert refusals[0].kind == "mutation"


def test_an_endpoint_cannot_run_while_the_payload_loads(refusals: list[pickling.Refusal]) -> None:
    """Its result would be an object of the server's that the rest of the payload could change."""
    with pytest.raises(pickling.RefusedPayload, match="call"):
        _load(_global("rpcps.endpoints", "server_ref") + pickle.EMPTY_TUPLE + pickle.REDUCE)
    assert refusals[0].kind == "call"


def test_newobj_and_garbage_are_refused_as_malformed(refusals: list[pickling.Refusal]) -> None:
    with pytest.raises(pickling.RefusedPayload, match="malformed"):
        _load(_global("rpcps.messages", "View") + pickle.EMPTY_TUPLE + pickle.NEWOBJ)
    with pytest.raises(pickling.RefusedPayload, match="malformed"):
        internal.deserialize(b"\x80\x04\x95garbage", [])
    assert [r.kind for r in refusals] == ["malformed", "malformed"]


def test_what_rpcps_sends_still_loads(refusals: list[pickling.Refusal]) -> None:
    reply = PushReply(PushStatus.STALE, 3, 2)
    payload, tensors = internal.serialize(internal.PythonUDF(endpoints.pull, (None, 1, "inc", reply), {}))
    opcodes = {op.name for op, _, _ in pickletools.genops(payload)}
    assert "REDUCE" in opcodes and not opcodes & {"NEWOBJ", "NEWOBJ_EX", "BUILD"}  # constructor calls only
    loaded = internal.deserialize(payload, tensors)
    assert pickling.unwrap(loaded.func) is endpoints.pull and loaded.args[3] == reply
    assert loaded.args[3].status is PushStatus.STALE
    assert refusals == []


# ---- the property: no opcode sequence over the allowed names changes anything --------------------

_POLICY = protection.unpickle_policy(rpc_policy.worker_api_surface(replica_endpoints.SERVER_ENDPOINTS))
_NAMES = sorted(_POLICY.allowed)
_ATTRIBUTES = [
    "_tensor_receiver", "_py_rref_receiver", "deserialize", "func", "__code__", "__defaults__", "__kwdefaults__",
    "__init__", "__call__", "__setstate__", "__class__", "_value_", "_name_", "value", "__dict__", "epoch", "x",
]


_GLOBALS = st.sampled_from(_NAMES).map(lambda n: _global(*n))
_VALUES = st.one_of(
    _GLOBALS,
    st.sampled_from(_ATTRIBUTES + [m.value for m in PushStatus]).map(_unicode),
    st.integers(0, 3).map(lambda i: pickle.BININT1 + bytes([i])),
    st.just(pickle.NONE),
)


@st.composite
def _gadget(draw: st.DrawFn) -> bytes:
    """An object a payload can reach (a name, or what calling one returned) and an opcode changing it."""
    target = draw(_GLOBALS)
    if draw(st.booleans()):
        args = draw(st.lists(_VALUES, max_size=3))
        target += pickle.MARK + b"".join(args) + pickle.TUPLE + pickle.REDUCE
    pairs = draw(st.lists(st.tuples(st.sampled_from(_ATTRIBUTES).map(_unicode), _VALUES), min_size=1, max_size=3))
    state = pickle.EMPTY_DICT + pickle.MARK + b"".join(k + v for k, v in pairs) + pickle.SETITEMS
    key, value = pairs[0]
    mutation = draw(st.sampled_from([
        state + pickle.BUILD,
        pickle.NONE + state + pickle.TUPLE2 + pickle.BUILD,  # slot state: setattr on the target
        key + value + pickle.SETITEM,
        pickle.MARK + key + value + pickle.SETITEMS,
        value + pickle.APPEND,
        pickle.MARK + value + pickle.APPENDS,
        pickle.MARK + value + pickle.ADDITEMS,
    ]))
    return target + mutation


def _token() -> st.SearchStrategy[bytes]:
    return st.one_of(
        _gadget(),
        _VALUES,
        st.integers(0, 12).map(lambda i: pickle.BINGET + bytes([i])),
        st.sampled_from([
            pickle.NONE, pickle.EMPTY_DICT, pickle.EMPTY_LIST, pickle.EMPTY_TUPLE, pickle.EMPTY_SET, pickle.MARK,
            pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3, pickle.TUPLE, pickle.DICT, pickle.LIST,
            pickle.REDUCE, pickle.BUILD, pickle.SETITEM, pickle.SETITEMS, pickle.APPEND, pickle.APPENDS,
            pickle.ADDITEMS, pickle.NEWOBJ, pickle.NEWOBJ_EX, pickle.OBJ, pickle.STACK_GLOBAL, pickle.MEMOIZE,
            pickle.DUP, pickle.POP, pickle.POP_MARK, pickle.FROZENSET,
        ]),
    )


def _fingerprint(obj: Any) -> dict[str, Any]:
    """Every attribute a payload could have rebound, by identity (and enum members by value)."""
    out: dict[str, Any] = {}
    if isinstance(obj, type):
        out.update({f"attr:{k}": id(v) for k, v in vars(obj).items()})
        if issubclass(obj, enum.Enum):
            for member in obj:
                out.update({f"{member.name}:{k}": repr(v) for k, v in vars(member).items()})
    elif isinstance(obj, types.FunctionType):
        out.update({
            "code": id(obj.__code__), "defaults": repr(obj.__defaults__), "kwdefaults": repr(obj.__kwdefaults__),
            "dict": repr(sorted(obj.__dict__)),
        })
    return out


def _world() -> dict[str, Any]:
    import sys

    state: dict[str, Any] = {}
    for (module, name), target in {**_POLICY.calls, **_POLICY.values}.items():
        state[f"{module}.{name}"] = _fingerprint(target)
        state[f"module:{module}"] = {k: id(v) for k, v in vars(sys.modules[module]).items()}
    state["pickler"] = _fingerprint(internal._InternalRPCPickler)
    return state


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(_token(), min_size=1, max_size=12))
def test_no_opcode_sequence_changes_an_allowed_class_function_or_module(
    refusals: list[pickling.Refusal], tokens: list[bytes]
) -> None:
    before = _world()
    try:
        _load(b"".join(tokens), [torch.zeros(2), torch.ones(3)])
    except pickling.RefusedPayload:
        pass
    assert _world() == before
    assert all(r.kind in pickling.REFUSAL_KINDS for r in refusals)


def test_the_fuzzer_reaches_the_mutating_opcodes(refusals: list[pickling.Refusal]) -> None:
    """The property above is only worth something if its alphabet can express the gadgets."""
    receiver_gadget = _global("torch.distributed.rpc.internal", "_InternalRPCPickler") + _slot_state(
        _tensor_receiver=pickle.NONE
    ) + pickle.BUILD
    assert ("torch.distributed.rpc.internal", "_InternalRPCPickler") in _NAMES and "_tensor_receiver" in _ATTRIBUTES
    assert struct.pack("B", pickle.BUILD[0]) in receiver_gadget
    with pytest.raises(pickling.RefusedPayload):
        _load(receiver_gadget)
