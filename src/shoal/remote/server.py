"""The reference remote tier's server (`shoal remote serve`): a ``TierService`` behind gRPC,
with the standard health service.

Streams are read on an asyncio event loop, so a stream that is slow or idle holds no
thread: only a whole call runs on the worker threads. Each stream must send its first
message, and each further one, within ``read_timeout_s``; one connection (a peer's address
and port) has at most ``streams_per_client`` calls in flight. The health check is answered
on the event loop and never waits for a worker.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shoal.errors import UsageError
from shoal.remote import wire
from shoal.remote.service import NEEDS_STATE, CallError, TierService

__all__ = ["NEEDS_STATE", "SERVICE", "RemoteServer", "ServeLimits", "TierService",
           "channel_options"]

SERVICE = "shoal.remote.v1.RemoteTier"


def channel_options() -> list[tuple[str, Any]]:
    """Message limits and keepalive, the same on both ends."""
    return [("grpc.max_send_message_length", wire.MAX_MESSAGE),
            ("grpc.max_receive_message_length", wire.MAX_MESSAGE),
            ("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000)]


@dataclass(frozen=True)
class ServeLimits:
    """What one client may hold of the server."""

    max_call_bytes: int = wire.MAX_CALL_BYTES
    """Tensor bytes one call may declare in its header (larger: INVALID_ARGUMENT)."""
    read_timeout_s: float = 10.0
    """A stream sends its first message, and each next one, within this many seconds."""
    streams_per_client: int = 8
    """Calls in flight on one connection (more: RESOURCE_EXHAUSTED)."""

    def __post_init__(self) -> None:
        for name in ("max_call_bytes", "read_timeout_s", "streams_per_client"):
            if not getattr(self, name) > 0:
                raise UsageError(f"{name} must be positive, got {getattr(self, name)}")


class _Calls:
    """The gRPC handlers: each stream read as it arrives, then run on a worker thread."""

    def __init__(self, service: TierService, limits: ServeLimits, workers: int):
        self.service, self.limits = service, limits
        self.pool = futures.ThreadPoolExecutor(max_workers=workers,
                                               thread_name_prefix="shoal-remote")
        self.in_flight: collections.Counter[str] = collections.Counter()

    async def capabilities(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            self.service.authorize(context.invocation_metadata())
        except CallError as exc:
            await context.abort(exc.code, str(exc))
        return self.service.capabilities()

    async def call(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        peer = context.peer()
        reply: list[bytes] = []
        try:
            self.service.authorize(context.invocation_metadata())
            if self.in_flight[peer] >= self.limits.streams_per_client:
                raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.limits.streams_per_client} calls in flight on this "
                                "connection already; wait for one to end")
            self.in_flight[peer] += 1
            try:
                reply = await self._run(context)
            finally:
                self.in_flight[peer] -= 1
                if not self.in_flight[peer]:
                    del self.in_flight[peer]
        except CallError as exc:
            await context.abort(exc.code, str(exc))
        except wire.WireError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # noqa: BLE001 - the module's own error, sent to the trainer
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        for message in reply:
            await context.write(message)

    async def _run(self, context: grpc.aio.ServicerContext) -> list[bytes]:
        decoder = wire.Decoder(self.limits.max_call_bytes)
        first = await self._read(context, "its header")
        if first is grpc.aio.EOF:
            raise wire.WireError("empty stream: no header")
        header = decoder.header(first)
        while (message := await self._read(context, "its next message")) is not grpc.aio.EOF:
            decoder.feed(message)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self.service.handle, header, decoder)

    async def _read(self, context: grpc.aio.ServicerContext, what: str) -> Any:
        try:
            return await asyncio.wait_for(context.read(), self.limits.read_timeout_s)
        except TimeoutError:
            raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"the stream did not send {what} within "
                            f"{self.limits.read_timeout_s:g} s (--read-timeout)") from None

    async def sweep(self) -> None:
        """Drop stale sessions every min(ttl / 4, 60 s): a session outlives its last call by
        at most ttl and that period."""
        period = min(self.service.session_ttl_s / 4, 60.0)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(period)
            await loop.run_in_executor(self.pool, self.service.sweep)


class RemoteServer:
    """A gRPC server for a ``TierService`` on an event loop of its own thread."""

    def __init__(self, service: TierService, host: str = "127.0.0.1", port: int = 0,
                 tls: tuple[bytes, bytes] | None = None, workers: int = 8,
                 limits: ServeLimits | None = None):
        self.service = service
        self.host = host
        self.limits = limits or ServeLimits()
        self.calls = _Calls(service, self.limits, workers)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="shoal-remote-io",
                                        daemon=True)
        self._thread.start()
        self._stopped = threading.Event()
        self._sweeper: asyncio.Future | None = None
        try:
            self.port = self._do(self._bind(host, port, tls))
        except BaseException:
            self._close_loop()
            raise

    def _do(self, coroutine: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    async def _bind(self, host: str, port: int, tls: tuple[bytes, bytes] | None) -> int:
        options = channel_options() + [
            # No SO_REUSEPORT: a second server on a taken port fails instead of sharing it.
            ("grpc.so_reuseport", 0),
            # Past this a well-behaved client queues its calls instead of being refused.
            ("grpc.max_concurrent_streams", self.limits.streams_per_client + 2)]
        self.server = grpc.aio.server(options=options)
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
            "Capabilities": grpc.unary_unary_rpc_method_handler(self.calls.capabilities),
            "Call": grpc.stream_stream_rpc_method_handler(self.calls.call)})])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if tls is None:
                bound = self.server.add_insecure_port(address)
            else:
                key, cert = tls
                bound = self.server.add_secure_port(
                    address, grpc.ssl_server_credentials([(key, cert)]))
        except RuntimeError as exc:
            raise UsageError(f"cannot listen on {address}: {exc}") from None
        if not bound:
            raise UsageError(f"cannot listen on {address}")
        return bound

    async def _start(self) -> None:
        await self.server.start()
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._sweeper = asyncio.ensure_future(self.calls.sweep())

    async def _stop(self, grace: float) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    def start(self) -> RemoteServer:
        self._do(self._start())
        return self

    def stop(self, grace: float = 1.0) -> None:
        if not self._stopped.is_set():
            self._do(self._stop(grace))
            self._close_loop()

    def _close_loop(self) -> None:
        self._stopped.set()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.calls.pool.shutdown(wait=False, cancel_futures=True)

    def wait(self) -> None:
        self._stopped.wait()
