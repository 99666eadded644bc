"""The reference remote tier's server: holds one module on its device and runs its forward
and backward for trainers, over gRPC (`shoal remote serve`).

Each trainer process has a session: the server keeps that session's copy of the module
(whose parameters the trainer sends whenever they changed), the forwards that wait for their
backward, and its last replies by request id, so a call repeated after a lost connection is
answered again instead of run twice.
"""

from __future__ import annotations

import contextlib
import copy
import hmac
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from torch import nn

from shoal.errors import UsageError
from shoal.remote import wire

SERVICE = "shoal.remote.v1.RemoteTier"
NEEDS_STATE = "shoal-remote: unknown session, send the module state"
KEEP_REPLIES = 4  # per session: enough for the retries of the last calls
KEEP_PENDING = 64  # forwards waiting for their backward (gradient accumulation, eval)
SESSION_IDLE_S = 3600.0


def channel_options() -> list[tuple[str, Any]]:
    """Message limits and keepalive, the same on both ends."""
    return [("grpc.max_send_message_length", wire.MAX_MESSAGE),
            ("grpc.max_receive_message_length", wire.MAX_MESSAGE),
            ("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000)]


def signature(module: nn.Module) -> dict[str, dict[str, tuple[list[int], str]]]:
    def spec(tensors):
        return {n: (list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors}
    return {"parameters": spec(module.named_parameters()),
            "buffers": spec(module.named_buffers())}


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class _Session:
    def __init__(self, module: nn.Module):
        self.module = module
        self.loaded = False
        self.lock = threading.Lock()
        self.pending: OrderedDict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = \
            OrderedDict()
        self.replies: OrderedDict[str, list[bytes]] = OrderedDict()
        self.used = time.monotonic()


class TierService:
    """The module and the sessions of the trainers that use it."""

    def __init__(self, builder: str, args: dict[str, Any] | None = None,
                 device: str | None = None, token: str | None = None):
        from shoal.imports import import_builder

        self.builder = builder
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        try:
            module = import_builder(builder, "--module")(**(args or {}))
        except UsageError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's builder may raise anything
            raise UsageError(f"--module {builder}: building it failed "
                             f"({type(exc).__name__}: {exc})") from None
        if not isinstance(module, nn.Module):
            raise UsageError(f"--module {builder} returned {type(module).__name__}, "
                             "not an nn.Module")
        self.base = module.to(self.device)
        self.signature = signature(self.base)
        self.token = token
        self.sessions: dict[str, _Session] = {}
        self.lock = threading.Lock()

    # -- RPCs --------------------------------------------------------------------------

    def capabilities(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._authorize(context)
        return json.dumps({"module": self.builder, "device": str(self.device),
                           "torch": torch.__version__, **self.signature}).encode()

    def call(self, messages: Iterator[bytes], context: grpc.ServicerContext
             ) -> Iterator[bytes]:
        self._authorize(context)
        try:
            header, tensors = wire.decode(messages, self.device)
            session = self._session(header)
            with session.lock:
                session.used = time.monotonic()
                request_id = header.get("request_id", "")
                reply = session.replies.get(request_id)
                if reply is None:
                    meta, out = self._run(session, header, tensors)
                    reply = list(wire.encode({**meta, "request_id": request_id}, out))
                    session.replies[request_id] = reply
                    while len(session.replies) > KEEP_REPLIES:
                        session.replies.popitem(last=False)
        except _Refused as exc:
            context.abort(exc.code, str(exc))
        except wire.WireError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # noqa: BLE001 - the module's own error, sent to the trainer
            context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        yield from reply

    # -- the work ----------------------------------------------------------------------

    def _authorize(self, context: grpc.ServicerContext) -> None:
        if self.token is None:
            return
        given = dict(context.invocation_metadata()).get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "wrong or missing bearer token" if given else "no bearer token sent")

    def _session(self, header: dict[str, Any]) -> _Session:
        key, op = header.get("session", ""), header.get("op")
        with self.lock:
            now = time.monotonic()
            for old in [k for k, s in self.sessions.items() if now - s.used > SESSION_IDLE_S]:
                del self.sessions[old]
            session = self.sessions.get(key)
            if op == "close":
                self.sessions.pop(key, None)
                return session or _Session(self.base)
            if session is None:
                if op != "forward":
                    raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"{op}: unknown session (the server restarted since its "
                                   "forward?)")
                session = self.sessions[key] = _Session(copy.deepcopy(self.base))
            return session

    def _run(self, session: _Session, header: dict[str, Any],
             tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
        op = header.get("op")
        if op == "forward":
            return self._forward(session, header, tensors)
        if op == "backward":
            return self._backward(session, header, tensors)
        if op == "close":
            return {}, {}
        raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"unknown op {op!r}")

    def _load(self, session: _Session, tensors: dict[str, torch.Tensor]) -> None:
        live = {**{f"param.{n}": p for n, p in session.module.named_parameters()},
                **{f"buffer.{n}": b for n, b in session.module.named_buffers()}}
        sent = {k: v for k, v in tensors.items() if k.startswith(("param.", "buffer."))}
        if not sent:
            return
        if set(sent) != set(live):
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"the module state sent does not match {self.builder}: "
                           f"missing {sorted(set(live) - set(sent))[:4]}, "
                           f"unknown {sorted(set(sent) - set(live))[:4]}")
        with torch.no_grad():
            for key, value in sent.items():
                if value.shape != live[key].shape:
                    raise _Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"{key}: shape {list(value.shape)} sent, "
                                   f"{list(live[key].shape)} served")
                live[key].copy_(value)
        session.loaded = True

    def _forward(self, session: _Session, header: dict[str, Any],
                 tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
        self._load(session, tensors)
        if not session.loaded:
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, NEEDS_STATE)
        grad = bool(header.get("grad"))
        inputs = [tensors[f"in.{i}"] for i in range(int(header.get("inputs", 0)))]
        if grad:
            inputs = [t.requires_grad_() if t.is_floating_point() else t for t in inputs]
        module = session.module
        module.train(bool(header.get("training")))
        dtype = header.get("autocast")
        autocast = (torch.autocast(self.device.type, dtype=getattr(torch, dtype)) if dtype
                    else contextlib.nullcontext())
        with torch.set_grad_enabled(grad), autocast:
            result = module(*inputs)
        single = isinstance(result, torch.Tensor)
        outputs = [result] if single else list(result)
        if grad:
            session.pending[header["request_id"]] = (inputs, outputs)
            while len(session.pending) > KEEP_PENDING:
                session.pending.popitem(last=False)
        reply = {f"out.{i}": out.detach() for i, out in enumerate(outputs)}
        if module.training:  # e.g. batch norm's running statistics moved
            reply.update({f"buffer.{n}": b for n, b in module.named_buffers()})
        return {"outputs": len(outputs), "single": single}, reply

    def _backward(self, session: _Session, header: dict[str, Any],
                  tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
        entry = session.pending.pop(header.get("forward_id", ""), None)
        if entry is None:
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                           "backward: its forward is not held here (the server restarted "
                           "since, or it was dropped)")
        inputs, outputs = entry
        params = dict(session.module.named_parameters())
        for p in params.values():
            p.grad = None
        pairs = [(out, tensors[f"gout.{i}"]) for i, out in enumerate(outputs)
                 if out.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        reply = {f"gin.{i}": t.grad for i, t in enumerate(inputs)
                 if t.requires_grad and t.grad is not None}
        reply.update({f"gparam.{n}": p.grad for n, p in params.items() if p.grad is not None})
        for p in params.values():
            p.grad = None
        return {}, reply


class RemoteServer:
    """A gRPC server for a ``TierService``, with the standard health service."""

    def __init__(self, service: TierService, host: str = "127.0.0.1", port: int = 0,
                 tls: tuple[bytes, bytes] | None = None, workers: int = 16):
        self.service = service
        self.host = host
        # No SO_REUSEPORT: a second server on a taken port fails instead of sharing it.
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                                  options=channel_options() + [("grpc.so_reuseport", 0)])
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
            "Capabilities": grpc.unary_unary_rpc_method_handler(service.capabilities),
            "Call": grpc.stream_stream_rpc_method_handler(service.call)})])
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if tls is None:
                self.port = self.server.add_insecure_port(address)
            else:
                key, cert = tls
                self.port = self.server.add_secure_port(
                    address, grpc.ssl_server_credentials([(key, cert)]))
        except RuntimeError as exc:
            raise UsageError(f"cannot listen on {address}: {exc}") from None
        if not self.port:
            raise UsageError(f"cannot listen on {address}")

    def start(self) -> RemoteServer:
        self.server.start()
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self, grace: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()

    def wait(self) -> None:
        self.server.wait_for_termination()
