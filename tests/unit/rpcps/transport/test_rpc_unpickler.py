"""The restricted unpickler, driven through torch's own RPC serialize/deserialize (one process, no agent).

What a peer's payload can name is exactly the worker API and its records; everything else is refused
before any of it runs. The same paths over real RPC: tests/integration/security/test_hostile_peers.py.
"""

from __future__ import annotations

import copyreg
import functools
import os
import pathlib
import pickle
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.distributed.rpc import internal

from ps.api.worker_service import WorkerService
from ps.control.control_service import ControlServicer
from ps.core.server import ParameterServer
from rpcps import endpoints, replica_endpoints, rpc_policy
from rpcps.messages import (
    Ack,
    Attached,
    ErrorReply,
    Fenced,
    Mark,
    Mode,
    PullReply,
    PushReply,
    PushStatus,
    Registered,
    Registration,
    RegistrationProof,
    Update,
    View,
)
from rpcps.transport import membership, pickling, protection


class _Reduce:
    """Pickles as ``func(*args)``: what an attacker's payload looks like inside an allowed call."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


@pytest.fixture
def refusals() -> Iterator[list[pickling.Refusal]]:
    seen: list[pickling.Refusal] = []
    rpc_policy.protect(on_refusal=seen.append, max_message_bytes=1 << 20)
    yield seen
    pickling.uninstall()


def roundtrip(obj: Any) -> Any:
    payload, tensors = internal.serialize(obj)
    return internal.deserialize(payload, tensors)


def call(func: Any, *args: Any) -> Any:
    return internal.PythonUDF(func, args, {})


def test_every_endpoint_and_record_is_allowed(refusals: list[pickling.Refusal]) -> None:
    allowed = protection.allowed_globals(rpc_policy.worker_api_surface())
    for fn in endpoints.ENDPOINTS:
        assert (fn.__module__, fn.__qualname__) in allowed, fn
        assert pickling.unwrap(roundtrip(call(fn, None, 0)).func) is fn
    assert pickling.unwrap(roundtrip(call(endpoints.submit, None)).func) is endpoints.submit  # the async_execution wrapper, by name
    replies = [
        Registration("inc", 3, 7, "sid", 1024, (10, 20), mode=Mode.SYNC),
        PushReply(PushStatus.APPLIED, 3, 0),
        PullReply(4, [torch.ones(2, dtype=torch.bfloat16), torch.arange(3)]),
        ErrorReply("UnknownWorker", "no"),
        RegistrationProof("c", "m"),
    ]
    for reply in replies:
        assert repr(roundtrip(reply)) == repr(reply)
    error = roundtrip(internal.RemoteException("boom", ValueError))
    assert error.msg == "boom" and pickling.unwrap(error.exception_type) is ValueError
    with pytest.raises(ValueError, match="boom"):
        internal._handle_exception(error)  # how torch raises a remote error on the caller
    assert refusals == []


def test_the_replication_api_is_callable_only_where_a_role_adds_it() -> None:
    """Servers add the replica endpoints to their surface and workers ``view_changed``; the worker
    API alone allows neither, so a worker cannot be made to serve state it does not hold."""
    plain = protection.allowed_globals(rpc_policy.worker_api_surface())
    server = protection.allowed_globals(rpc_policy.worker_api_surface(replica_endpoints.SERVER_ENDPOINTS))
    worker = protection.allowed_globals(rpc_policy.worker_api_surface(replica_endpoints.WORKER_ENDPOINTS))
    for fn in replica_endpoints.SERVER_ENDPOINTS:
        name = (fn.__module__, fn.__qualname__)
        assert name in server and name not in plain and name not in worker, fn
    view_changed = (replica_endpoints.view_changed.__module__, replica_endpoints.view_changed.__qualname__)
    assert view_changed in worker and view_changed not in server and view_changed not in plain


def test_every_record_a_replica_sends_is_allowed() -> None:
    seen: list[pickling.Refusal] = []
    rpc_policy.protect(on_refusal=seen.append, extra_calls=replica_endpoints.SERVER_ENDPOINTS)
    try:
        entries = [
            Update(4, 2, 9, [torch.ones(3)], ((0, 5, 0.5, 1),), [torch.zeros(2)]),
            Mark(5, 2, 1, 6),
            Registered(6, 2, 1, "worker1_r4", "inc"),
        ]
        assert pickling.unwrap(roundtrip(call(replica_endpoints.replica_append, "a" * 32, 2, "ps0_r3", entries, 1.0, True)).func) is replica_endpoints.replica_append
        for reply in [Ack(2, 6, 5), Fenced(3, "ps0_r5"), Attached("a", 2, 6, 9, 1024, 1), View(3, "ps0_r5", "ps0_r3")]:
            assert repr(roundtrip(reply)) == repr(reply)
        assert seen == []
    finally:
        pickling.uninstall()


def test_a_standby_s_attach_request_passes_the_allow_list() -> None:
    """What a standby sends its primary to follow it (its compatibility: plain strings only; a
    TorchVersion in it was refused once, and no standby could attach)."""
    from harness.inprocess import make_server
    from ps.config import ServerRunConfig
    from ps.replication.auth import attach_proof
    from ps.replication.replica import compatibility
    from rpcps.jobsecret import JobSecret

    server, _ = make_server()
    seen: list[pickling.Refusal] = []
    rpc_policy.protect(on_refusal=seen.append, extra_calls=replica_endpoints.SERVER_ENDPOINTS)
    try:
        proof = attach_proof(JobSecret("s" * 40), "ps0_r2", "ps0_r1")  # nonce, unix time, mac: plain values
        request = call(replica_endpoints.replica_attach, "ps0_r2", compatibility(server, ServerRunConfig(model="m")), *proof)
        assert pickling.unwrap(roundtrip(request).func) is replica_endpoints.replica_attach
        assert seen == []
    finally:
        pickling.uninstall()


def test_the_transport_itself_needs_only_its_probe_and_the_leave_request(refusals: list[pickling.Refusal]) -> None:
    assert pickling.unwrap(roundtrip(call(membership.forget_me, "w", "proof")).func) is membership.forget_me
    guarded = roundtrip(call(pickling._rpc_utils._update_group_membership, None, [], {}, True)).func
    assert pickling.unwrap(guarded) is membership.guarded_update_group_membership


@pytest.mark.parametrize(
    ("func", "args"),
    [
        (os.system, ("true",)),
        (eval, ("1",)),
        (exec, ("pass",)),
        (pathlib.Path.write_text, (pathlib.Path("/nonexistent/x"), "x")),
        (functools.partial(os.system, "true"), ()),
        (subprocess.Popen, (["true"],)),
        (_Reduce(getattr, _Reduce(getattr, internal._InternalRPCPickler, "deserialize"), "__globals__"), ()),
        (_Reduce(getattr, internal._InternalRPCPickler, "_script_module_receiver"), (b"",)),
        (endpoints.register, (_Reduce(os.system, "true"),)),  # an allowed target, a gadget in its arguments
        (torch.load, ("/etc/hostname",)),
    ],
)
def test_gadgets_are_refused_before_running(refusals: list[pickling.Refusal], func: Any, args: tuple[Any, ...]) -> None:
    payload, tensors = internal.serialize(call(func, *args))
    with pytest.raises(pickling.RefusedPayload, match="rpc payload refused"):
        internal.deserialize(payload, tensors)
    assert len(refusals) == 1 and refusals[0].kind in ("global", "getattr")


@pytest.mark.parametrize(
    "method",
    [
        ParameterServer.pause, ParameterServer.resume, ParameterServer.stop, ParameterServer.finish,
        ParameterServer.restore_state, ParameterServer.capture_state, ParameterServer.__setattr__,
        WorkerService.register, WorkerService.mark_dead, endpoints.publish, endpoints._api,
        membership.forget_member, ControlServicer.Shutdown,
    ],
)
def test_no_server_method_is_callable(refusals: list[pickling.Refusal], method: Any) -> None:
    """Everything but the worker API (pause, stop, restore, capture...) is the control plane's."""
    with pytest.raises(pickling.RefusedPayload):
        roundtrip(call(method, None))


def test_a_refusal_is_not_returned_as_a_value(refusals: list[pickling.Refusal]) -> None:
    """torch turns an AttributeError into a return value; a refusal must raise through instead."""
    with pytest.raises(pickling.RefusedPayload):
        roundtrip(PushReply(_Reduce(os.system, "true"), 1, 0))  # type: ignore[arg-type]


def test_a_refused_message_does_not_pin_its_tensors(refusals: list[pickling.Refusal]) -> None:
    payload, tensors = internal.serialize(call(os.system, torch.zeros(1000)))
    with pytest.raises(pickling.RefusedPayload):
        internal.deserialize(payload, tensors)
    assert not hasattr(internal._thread_local_tensor_tables, "recv_tables")


def test_oversized_messages_are_refused_before_running(refusals: list[pickling.Refusal]) -> None:
    payload, tensors = internal.serialize(call(endpoints.submit, None, 0, "inc", 1, 0, [torch.zeros(300_000)], None))
    with pytest.raises(pickling.RefusedPayload, match="size"):
        internal.deserialize(payload, tensors)
    assert refusals[0].kind == "size" and refusals[0].message_bytes > 1 << 20
    pickling.set_max_message_bytes(None)
    assert pickling.unwrap(roundtrip(call(endpoints.submit, None, 0, "inc", 1, 0, [torch.zeros(300_000)], None)).func) is endpoints.submit


def test_the_default_message_limit_fits_a_full_topk_push() -> None:
    n = 1_000_000
    indices, values = torch.arange(n), torch.zeros(n)
    carried = indices.nelement() * indices.element_size() + values.nelement() * values.element_size()
    assert rpc_policy.message_limit(n, None) >= carried
    assert rpc_policy.message_limit(n, 2.0) == 2 << 20


def test_a_broken_callback_still_refuses() -> None:
    def broken(_: pickling.Refusal) -> None:
        raise RuntimeError("callback bug")

    rpc_policy.protect(on_refusal=broken)
    try:
        with pytest.raises(pickling.RefusedPayload):
            roundtrip(call(os.system, "true"))
    finally:
        pickling.uninstall()


def test_copyreg_extensions_fail_closed(refusals: list[pickling.Refusal]) -> None:
    """A resolved copyreg extension code would bypass find_class: everything is refused instead."""
    copyreg.add_extension("posix", "system", 240)
    try:
        assert pickle.loads(pickle.dumps(os.system, protocol=2)) is os.system  # a plain unpickler fills the cache
        with pytest.raises(pickling.RefusedPayload, match="copyreg"):
            roundtrip(PushReply(PushStatus.APPLIED, 1, 0))
    finally:
        copyreg.remove_extension("posix", "system", 240)
        copyreg.clear_extension_cache()


def test_install_fails_loudly_when_torch_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    surface = rpc_policy.worker_api_surface()
    monkeypatch.setattr(internal, "_unpickler", type("Other", (pickle.Unpickler,), {}))
    with pytest.raises(pickling.TorchInternalsChanged, match="_unpickler"):
        protection.protect(surface)
    monkeypatch.undo()
    monkeypatch.delattr(internal._InternalRPCPickler, "_tensor_receiver")
    with pytest.raises(pickling.TorchInternalsChanged, match="_tensor_receiver"):
        protection.protect(surface)
    monkeypatch.undo()
    pickling.uninstall()


def test_policies_name_only_importable_objects() -> None:
    with pytest.raises(ValueError, match="no importable name"):
        protection.Surface(calls=(lambda: None,))
    with pytest.raises(ValueError, match="lacks"):
        pickling.install(pickling.UnpicklePolicy(calls=pickling.named(endpoints.pull), values={}))
    with pytest.raises(ValueError, match="either a call or a value"):
        pickling.UnpicklePolicy(calls=pickling.named(print), values=pickling.named(print))
    with pytest.raises(ValueError, match="WireRecord"):
        protection.Surface(calls=(), values=(pathlib.Path,))

