"""What `shoal remote serve` does with a call: the module, the trainers' sessions, and the
checks that turn a malformed call into one line with a gRPC status code.

Each trainer process has a session: the server keeps that session's copy of the module
(whose parameters the trainer sends whenever they changed), the forwards that wait for their
backward, and its last replies by request id, so a call repeated after a lost connection is
answered again instead of run twice. A session is made only by a forward that brings the
module's whole state, and is dropped once unused for ``session_ttl_s``.
"""

from __future__ import annotations

import contextlib
import copy
import hmac
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import grpc
import torch
from torch import nn

from shoal.errors import UsageError
from shoal.remote import wire

NEEDS_STATE = "shoal-remote: unknown session, send the module state"
KEEP_REPLIES = 4  # per session: enough for the retries of the last calls
KEEP_PENDING = 64  # forwards waiting for their backward (gradient accumulation, eval)
SESSION_TTL_S = 600.0
MAX_SESSIONS = 256  # trainer processes one server holds a module copy for
MAX_ID = 128  # characters of a session or request id
AUTOCAST = ("float16", "bfloat16")


class CallError(Exception):
    """A call refused, with the status code the trainer gets."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _invalid(message: str) -> CallError:
    return CallError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def signature(module: nn.Module) -> dict[str, dict[str, tuple[list[int], str]]]:
    def spec(tensors):
        return {n: (list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in tensors}
    return {"parameters": spec(module.named_parameters()),
            "buffers": spec(module.named_buffers())}


class _Session:
    def __init__(self, module: nn.Module):
        self.module = module
        self.lock = threading.Lock()
        self.pending: OrderedDict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = \
            OrderedDict()
        self.replies: OrderedDict[str, list[bytes]] = OrderedDict()
        self.used = time.monotonic()


class TierService:
    """The module and the sessions of the trainers that use it (thread-safe)."""

    def __init__(self, builder: str, args: dict[str, Any] | None = None,
                 device: str | None = None, token: str | None = None,
                 session_ttl_s: float = SESSION_TTL_S, max_sessions: int = MAX_SESSIONS):
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
        self.state_specs = {
            **{f"param.{n}": s for n, s in self.signature["parameters"].items()},
            **{f"buffer.{n}": s for n, s in self.signature["buffers"].items()}}
        self.token = token
        if not session_ttl_s > 0:
            raise UsageError(f"--session-ttl must be positive, got {session_ttl_s:g}")
        self.session_ttl_s = session_ttl_s
        self.max_sessions = max_sessions
        self.sessions: dict[str, _Session] = {}
        self.lock = threading.Lock()

    def capabilities(self) -> bytes:
        return json.dumps({"module": self.builder, "device": str(self.device),
                           "torch": torch.__version__, **self.signature}).encode()

    def authorize(self, metadata: Sequence[tuple[str, Any]] | None) -> None:
        if self.token is None:
            return
        given = dict(metadata or ()).get("authorization", "")
        given = given.encode() if isinstance(given, str) else bytes(given)
        if not hmac.compare_digest(given, f"Bearer {self.token}".encode()):
            raise CallError(grpc.StatusCode.UNAUTHENTICATED,
                            "wrong or missing bearer token" if given else "no bearer token sent")

    def sweep(self) -> int:
        """Drop the sessions unused for ``session_ttl_s``; how many were dropped."""
        with self.lock:
            now = time.monotonic()
            stale = [k for k, s in self.sessions.items() if now - s.used > self.session_ttl_s]
            for key in stale:
                del self.sessions[key]
        return len(stale)

    def handle(self, header: dict[str, Any], decoder: wire.Decoder) -> list[bytes]:
        """The reply's messages to one call; CallError (or WireError) when refused, any other
        exception is the module's own."""
        op = _check_header(header, self.builder, decoder.names)
        tensors = decoder.tensors(self.device)
        key = header["session"]
        if op == "close":
            with self.lock:
                self.sessions.pop(key, None)
            return list(wire.encode({"request_id": header.get("request_id", "")}, {}))
        session = self._session(key, op, tensors)
        with session.lock:
            session.used = time.monotonic()
            request_id = header.get("request_id", "")
            reply = session.replies.get(request_id)
            if reply is None:
                if op == "forward":
                    meta, out = self._forward(session, header, tensors)
                else:
                    meta, out = self._backward(session, header, tensors)
                reply = list(wire.encode({**meta, "request_id": request_id}, out))
                session.replies[request_id] = reply
                while len(session.replies) > KEEP_REPLIES:
                    session.replies.popitem(last=False)
        return reply

    # -- sessions and state ------------------------------------------------------------

    def _session(self, key: str, op: str, tensors: dict[str, torch.Tensor]) -> _Session:
        with self.lock:
            session = self.sessions.get(key)
        if session is not None:
            return session
        if op != "forward":
            raise CallError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"{op}: unknown session (the server restarted since its forward?)")
        if not self._sent_state(tensors):  # nothing is kept for a call that brings no state
            raise CallError(grpc.StatusCode.FAILED_PRECONDITION, NEEDS_STATE)
        self.sweep()
        with self.lock:
            full = len(self.sessions) >= self.max_sessions
        if full:
            raise CallError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"the server holds {self.max_sessions} sessions already (one per "
                            "trainer process; an unused one goes after --session-ttl)")
        module = copy.deepcopy(self.base)
        with self.lock:
            return self.sessions.setdefault(key, _Session(module))

    def _sent_state(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The module state the call carries (none, or all of it, matching what is served)."""
        sent = {k: v for k, v in tensors.items() if k.startswith(("param.", "buffer."))}
        if not sent:
            return sent
        if set(sent) != set(self.state_specs):
            raise _invalid(f"the module state sent does not match {self.builder}: missing "
                           f"{sorted(set(self.state_specs) - set(sent))[:4]}, unknown "
                           f"{[k[:60] for k in sorted(set(sent) - set(self.state_specs))[:4]]}")
        for key, value in sent.items():
            shape, dtype = self.state_specs[key]
            if list(value.shape) != shape or _name(value.dtype) != dtype:
                raise _invalid(f"{key}: {_name(value.dtype)} "
                               f"{list(value.shape)} sent, {dtype} {shape} served")
        return sent

    def _load(self, session: _Session, tensors: dict[str, torch.Tensor]) -> None:
        sent = self._sent_state(tensors)
        live = {**{f"param.{n}": p for n, p in session.module.named_parameters()},
                **{f"buffer.{n}": b for n, b in session.module.named_buffers()}}
        with torch.no_grad():
            for key, value in sent.items():
                live[key].copy_(value)

    # -- the work ----------------------------------------------------------------------

    def _forward(self, session: _Session, header: dict[str, Any],
                 tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
        self._load(session, tensors)
        grad = header.get("grad") is True
        inputs = [tensors[f"in.{i}"] for i in range(header.get("inputs", 0))]
        if grad:
            inputs = [t.requires_grad_() if t.is_floating_point() else t for t in inputs]
        module = session.module
        module.train(header.get("training") is True)
        dtype = header.get("autocast")
        autocast = (torch.autocast(self.device.type, dtype=getattr(torch, dtype)) if dtype
                    else contextlib.nullcontext())
        with torch.set_grad_enabled(grad), autocast:
            result = module(*inputs)
        single = isinstance(result, torch.Tensor)
        outputs = [result] if single else list(result)
        if not all(isinstance(out, torch.Tensor) for out in outputs):
            raise TypeError(f"{self.builder}'s forward returned {type(result).__name__}, "
                            "not a tensor or a sequence of tensors")
        if grad:
            session.pending[header.get("request_id", "")] = (inputs, outputs)
            while len(session.pending) > KEEP_PENDING:
                session.pending.popitem(last=False)
        reply = {f"out.{i}": out.detach() for i, out in enumerate(outputs)}
        if module.training:  # e.g. batch norm's running statistics moved
            reply.update({f"buffer.{n}": b for n, b in module.named_buffers()})
        return {"outputs": len(outputs), "single": single}, reply

    def _backward(self, session: _Session, header: dict[str, Any],
                  tensors: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
        entry = session.pending.get(header.get("forward_id", ""))
        if entry is None:
            raise CallError(grpc.StatusCode.FAILED_PRECONDITION,
                            "backward: its forward is not held here (the server restarted "
                            "since, or it was dropped)")
        inputs, outputs = entry
        pairs = []
        for i, out in enumerate(outputs):
            if not out.requires_grad:
                continue
            grad = tensors.get(f"gout.{i}")
            if grad is None or grad.shape != out.shape or grad.dtype != out.dtype:
                got = "none" if grad is None else f"{_name(grad.dtype)} {list(grad.shape)}"
                raise _invalid(f"backward: gout.{i} must be {_name(out.dtype)} "
                               f"{list(out.shape)} like out.{i}; got {got}")
            pairs.append((out, grad))
        del session.pending[header.get("forward_id", "")]
        params = dict(session.module.named_parameters())
        for p in params.values():
            p.grad = None
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        reply = {f"gin.{i}": t.grad for i, t in enumerate(inputs)
                 if t.requires_grad and t.grad is not None}
        reply.update({f"gparam.{n}": p.grad for n, p in params.items() if p.grad is not None})
        for p in params.values():
            p.grad = None
        return {}, reply


def _check_header(header: dict[str, Any], builder: str, names: set[str]) -> str:
    """The call's op, once its header's fields are what they must be (else INVALID_ARGUMENT,
    or FAILED_PRECONDITION when the call was made for another module)."""
    op = header.get("op")
    if op not in ("forward", "backward", "close"):
        raise _invalid(f"unknown op {str(op)[:40]!r} (forward, backward or close)")
    for name in ("session", "request_id", "forward_id"):
        value = header.get(name, "")
        if not isinstance(value, str) or len(value) > MAX_ID:
            raise _invalid(f"{name} must be a string of at most {MAX_ID} characters")
    if not header.get("session"):
        raise _invalid("no session in the header")
    module = header.get("module")
    if module is not None and module != builder:
        raise CallError(grpc.StatusCode.FAILED_PRECONDITION,
                        f"this server serves {builder}, not {str(module)[:200]}")
    if op == "forward":
        inputs = header.get("inputs", 0)
        if type(inputs) is not int or not 0 <= inputs <= len(names):
            raise _invalid(f"inputs must be the number of in.<i> tensors sent, not "
                           f"{str(inputs)[:20]}")
        missing = [i for i in range(inputs) if f"in.{i}" not in names]
        if missing:
            raise _invalid(f"in.{missing[0]} is not among the tensors sent")
        if header.get("autocast") not in (None, *AUTOCAST):
            raise _invalid(f"autocast must be one of {', '.join(AUTOCAST)} or null")
    return op
