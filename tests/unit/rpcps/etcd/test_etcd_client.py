"""EtcdClient against a member that is cut off (its connection open, nothing answering: what a
pulled cable looks like from the other hosts) and a real gRPC member that answers: a read reaches
the answering member within its deadline, and a write that timed out sends the next call there.
A standby across hosts never promoted without this (tests/integration/deploy/test_multihost.py)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from rpcps.address import Address
from rpcps.etcd import rpc_pb2, rpc_pb2_grpc
from rpcps.etcd.client import EtcdClient, EtcdUnavailable

TIMEOUT_S = 1.0


class _Member(rpc_pb2_grpc.KVServicer):
    """Answers every read with no keys and every transaction with success."""

    def Range(self, request: rpc_pb2.RangeRequest, context: grpc.ServicerContext) -> rpc_pb2.RangeResponse:
        return rpc_pb2.RangeResponse(count=0)

    def Txn(self, request: rpc_pb2.TxnRequest, context: grpc.ServicerContext) -> rpc_pb2.TxnResponse:
        return rpc_pb2.TxnResponse(succeeded=True)


@pytest.fixture
def member() -> Iterator[Address]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rpc_pb2_grpc.add_KVServicer_to_server(_Member(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield Address("127.0.0.1", port)
    server.stop(grace=None)


@pytest.fixture
def cut_off() -> Iterator[Address]:
    """A listener that accepts connections and never says a word."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield Address("127.0.0.1", listener.getsockname()[1])


@pytest.fixture
def client(cut_off: Address, member: Address) -> Iterator[EtcdClient]:
    """A client whose first endpoint is the cut-off member."""
    client = EtcdClient([cut_off, member], timeout_s=TIMEOUT_S)
    yield client
    client.close()


@pytest.mark.timeout(30)
def test_a_read_reaches_the_next_member_within_its_deadline_and_later_calls_start_there(client: EtcdClient) -> None:
    started = time.monotonic()
    assert client.range(b"k").count == 0
    assert time.monotonic() - started < TIMEOUT_S + 0.5
    started = time.monotonic()
    assert client.range(b"k").count == 0
    assert time.monotonic() - started < TIMEOUT_S / 2, "the cut-off member is not asked first again"


@pytest.mark.timeout(30)
def test_a_write_that_timed_out_is_not_repeated_but_the_next_call_goes_to_another_member(client: EtcdClient) -> None:
    with pytest.raises(EtcdUnavailable, match="did not answer a transaction"):
        client.txn([], [])  # it may have been applied: not sent again
    assert client.txn([], []).succeeded
