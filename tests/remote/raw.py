"""Hand-made calls to a remote tier server: raw bytes on a real gRPC channel, for streams
that no client of ours would send."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shoal.remote.server import SERVICE

# No more is held by a stream that waits in the tests; the server's read timeout ends it.
HOLD_S = 30.0


def channel(endpoint: str) -> grpc.Channel:
    """A channel with a connection of its own (not shared with other channels)."""
    return grpc.insecure_channel(endpoint, [("grpc.use_local_subchannel_pool", 1),
                                            ("grpc.enable_retries", 0)])


def header(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def call(chan: grpc.Channel, messages: Iterable[bytes], metadata: Any = (),
         timeout: float = 10.0) -> tuple[grpc.StatusCode, str, list[bytes]]:
    """Send ``messages`` as one Call; the status code, its details and the reply."""
    stub = chan.stream_stream(f"/{SERVICE}/Call")
    replies: list[bytes] = []
    try:
        for reply in stub(iter(messages), timeout=timeout, metadata=metadata):
            replies.append(reply)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", replies
    return grpc.StatusCode.OK, "", replies


def held(messages: Iterable[bytes], release: threading.Event) -> Iterator[bytes]:
    """``messages``, then nothing until ``release`` is set: a stream left open."""
    yield from messages
    release.wait(HOLD_S)


def healthy(chan: grpc.Channel, timeout: float) -> bool:
    try:
        reply = health_pb2_grpc.HealthStub(chan).Check(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=timeout)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
