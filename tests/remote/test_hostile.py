"""The remote tier's server under hostile or broken streams, sent as raw bytes over real gRPC
on loopback: a header's declared sizes cost nothing until their bytes arrive, and malformed
ones are INVALID_ARGUMENT with one line; idle streams starve neither the health check nor a
trainer; a refused call leaves no session, and stale sessions go on schedule."""

from __future__ import annotations

import json
import threading
import time

import grpc
import psutil
import pytest
import torch

from shoal.remote import GrpcRemoteTier, RemoteModule, RemoteTierError, wire
from shoal.remote.server import NEEDS_STATE, SERVICE, RemoteServer, TierService
from tests.remote import raw
from tests.remote.blocks import Block
from tests.remote.conftest import wait_for


def _spec(shape, dtype="float32", name="in.0"):
    return json.dumps({"op": "forward", "session": "s", "inputs": 1,
                       "tensors": [{"name": name, "dtype": dtype, "shape": shape}]}).encode()


MALFORMED = [
    (_spec([-1]), "shape [-1] is not a list of at most 32 non-negative integers"),
    (_spec([4, -2]), "shape [4, -2] is not a list"),
    (_spec([2.5]), "shape [2.5] is not a list"),
    (_spec("12"), "shape 12 is not a list"),
    (_spec([True]), "shape [True] is not a list"),
    (_spec([1] * 33), "is not a list of at most 32"),
    (_spec([1 << 40, 1 << 40]), "has more than 281,474,976,710,656 elements"),
    (_spec([0, 1 << 62, 1 << 62]), "has more than"),
    (_spec([1 << 29]), "lists 2,147,483,648+ bytes of tensors; this server takes at most "
     "1,073,741,824 per call"),
    (_spec([1], dtype="float8"), "unknown dtype 'float8'"),
    (_spec([1], dtype=["float32"]), "unknown dtype \"['float32']\""),
    (_spec([1], name=7), "a tensor spec must be an object with a string 'name'"),
    (b"[1, 2]", "the header is a JSON array, not an object"),
    (b'{"tensors": 5}', "the header's 'tensors' is not a list"),
    (b"\xff\xfe", "the first message is not a JSON header"),
    (json.dumps({"tensors": [{"name": "a", "dtype": "int8", "shape": [1]}] * 2}).encode(),
     "tensor 'a' is listed twice"),
    (json.dumps({"op": "forward", "session": ["a"]}).encode(),
     "session must be a string of at most 128 characters"),
    (json.dumps({"op": "forward", "session": "s", "inputs": 3}).encode(),
     "inputs must be the number of in.<i> tensors sent, not 3"),
    (json.dumps({"op": "explode", "session": "s"}).encode(), "unknown op 'explode'"),
]


def test_malformed_shapes_and_dtypes_are_invalid_argument_in_one_line(serve):
    server = serve()
    chan = raw.channel(server.endpoint)
    for first, reason in MALFORMED:
        code, details, _ = raw.call(chan, [first])
        assert (code, "\n" in details) == (grpc.StatusCode.INVALID_ARGUMENT, False), \
            (first, code, details)
        assert reason in details, (first, details)
    # More bytes than the header lists: refused as they arrive, not kept.
    code, details, _ = raw.call(chan, [_spec([4]), b"\0" * 16, b"\0"])
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "the stream holds more than the 16 bytes of tensors its header lists"
    assert raw.healthy(chan, timeout=5)


def test_a_declared_size_costs_nothing_before_its_bytes_arrive(serve):
    server = serve()
    chan = raw.channel(server.endpoint)
    process = psutil.Process(server.proc.pid)
    before = process.memory_info().rss
    release = threading.Event()
    # 256 MiB declared (under the limit), 1 KiB sent, then the stream is held open.
    stub = chan.stream_stream(f"/{SERVICE}/Call")
    pending = stub(raw.held([_spec([1 << 26]), b"\0" * 1024], release), timeout=30)
    time.sleep(1.5)  # the server has read what came
    grown = process.memory_info().rss - before
    release.set()
    with pytest.raises(grpc.RpcError) as info:
        list(pending)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "holds 1024 bytes of tensors; the header lists 268435456" in info.value.details()
    assert grown < 64 << 20, f"the server grew by {grown >> 20} MiB for 1 KiB received"


def test_idle_streams_starve_neither_the_health_check_nor_a_trainer(serve):
    # 4 s: the idle streams must outlast the checks below on a loaded machine.
    server = serve("--read-timeout", "4")
    release = threading.Event()
    connections = [raw.channel(server.endpoint) for _ in range(4)]
    idle = [chan.stream_stream(f"/{SERVICE}/Call")(raw.held([], release), timeout=30)
            for chan in connections for _ in range(8)]  # 32 streams that never send a byte
    half = [chan.stream_stream(f"/{SERVICE}/Call")(raw.held([_spec([4])], release), timeout=30)
            for chan in (raw.channel(server.endpoint),)]  # a header and then nothing
    time.sleep(0.5)
    # A ninth call in flight on one connection is refused at once.
    code, details, _ = raw.call(connections[0], raw.held([], release), timeout=5)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert details == "8 calls in flight on this connection already; wait for one to end"
    assert raw.healthy(raw.channel(server.endpoint), timeout=2)
    tier = GrpcRemoteTier({"endpoint": server.endpoint, "deadline_s": 3})
    block = Block()
    x = torch.randn(4, 32)
    with torch.no_grad():
        assert torch.equal(RemoteModule(block, tier=tier)(x), block(x))
    # The server ends the idle streams itself, by its read deadline.
    for pending, what in [(p, "its header") for p in idle] + [(half[0], "its next message")]:
        assert pending.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert pending.details() == f"the stream did not send {what} within 4 s (--read-timeout)"
    release.set()
    tier.close()


@pytest.fixture
def in_process():
    """``in_process(**service_args)``: a server in this process (real gRPC on loopback),
    whose sessions the test can count; stopped at the end."""
    servers = []

    def make(**kwargs) -> tuple[TierService, str]:
        service = TierService("tests.remote.blocks:block", {"width": 128}, "cpu", **kwargs)
        servers.append(RemoteServer(service).start())
        return service, f"127.0.0.1:{servers[-1].port}"
    yield make
    for server in servers:
        server.stop(0)


def test_refused_calls_leave_no_session_behind(in_process):
    service, endpoint = in_process()
    chan = raw.channel(endpoint)
    x = torch.randn(2, 128)
    for i in range(500):  # forwards without the module's state: nothing to run with
        code, details, _ = raw.call(chan, wire.encode(
            {"op": "forward", "session": f"s{i}", "request_id": "r", "inputs": 1},
            {"in.0": x}))
        assert (code, details) == (grpc.StatusCode.FAILED_PRECONDITION, NEEDS_STATE)
    wrong = {"in.0": x, "param.fc1.weight": torch.zeros(1)}
    code, details, _ = raw.call(chan, wire.encode(
        {"op": "forward", "session": "w", "request_id": "r", "inputs": 1}, wrong))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "the module state sent does not match tests.remote.blocks:block" in details
    assert len(service.sessions) == 0


def test_stale_sessions_are_dropped_on_schedule_and_the_trainer_carries_on(in_process):
    service, endpoint = in_process(session_ttl_s=0.6)  # checked every 0.15 s
    tier = GrpcRemoteTier({"endpoint": endpoint, "deadline_s": 10})
    block = Block(128)
    remote = RemoteModule(block, tier=tier)
    x = torch.randn(3, 128)
    with torch.no_grad():
        remote(x)
    assert list(service.sessions) == [tier.session]
    dropped = time.monotonic()
    wait_for(lambda: not service.sessions, 5, "the stale session to be dropped")
    assert time.monotonic() - dropped >= 0.5
    with torch.no_grad():  # the server asks for the state again, and gets it
        assert torch.equal(remote(x), block(x))
    tier.close()
    assert not service.sessions


def test_sessions_are_bounded_in_number(in_process):
    service, endpoint = in_process(max_sessions=2)
    x = torch.randn(2, 128)
    tiers = [GrpcRemoteTier({"endpoint": endpoint, "deadline_s": 10}) for _ in range(3)]
    blocks = [Block(128) for _ in tiers]
    remotes = [RemoteModule(block, tier=tier) for block, tier in zip(blocks, tiers, strict=True)]
    with torch.no_grad():
        remotes[0](x), remotes[1](x)
        with pytest.raises(RemoteTierError, match=r"RESOURCE_EXHAUSTED: the server holds 2 "
                           r"sessions already \(one per trainer process; an unused one goes "
                           r"after --session-ttl\)$"):
            remotes[2](x)
        tiers[0].close()  # a trainer that ends leaves room
        assert torch.equal(remotes[2](x), blocks[2](x))
    for tier in tiers[1:]:
        tier.close()
    assert not service.sessions
