"""``GrpcRemoteTier``: the reference remote tier, a client of `shoal remote serve`."""

from __future__ import annotations

import json
import sys
import time
import uuid
from typing import Any, cast

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shoal.errors import UsageError
from shoal.remote import wire
from shoal.remote.server import NEEDS_STATE, SERVICE, channel_options
from shoal.remote.tier import Capabilities, NeedsState, RemoteConfig, RemoteTierError

# Lost connections: tried again with the same request id.
_RETRY = {grpc.StatusCode.UNAVAILABLE}
WAIT_LINE_EVERY_S = 10.0  # while on_failure 'wait' waits, one line this often


class GrpcRemoteTier:
    """Calls a `shoal remote serve` server over one gRPC channel (TLS unless the endpoint is
    loopback or the config says insecure), with the bearer token on every call, keepalive,
    a deadline on every call, and retries of lost connections under the same request id.

    Raises:
        UsageError: If the token file or variable is missing, empty or not a valid token
            (printable ASCII, at most 4096 bytes), or ``tls_ca`` cannot be read.
        pydantic.ValidationError: If ``config`` is a dict with an unknown or invalid setting
            (see ``RemoteConfig``).
    """

    def __init__(self, config: RemoteConfig | dict[str, Any]):
        self.config = config if isinstance(config, RemoteConfig) else RemoteConfig(**config)
        self.endpoint = self.config.endpoint
        token = self.config.token()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        # A connection of its own: the server bounds the calls in flight per connection.
        options = channel_options() + [("grpc.enable_retries", 0),
                                       ("grpc.use_local_subchannel_pool", 1)]
        if self.config.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.config.tls_server_name))
        if self.config.tls_ca:
            try:
                with open(self.config.tls_ca, "rb") as f:
                    ca = f.read()
            except OSError as exc:
                raise UsageError(f"remote_hardware.tls_ca {self.config.tls_ca}: "
                                 f"{exc.strerror}") from None
            self._channel = grpc.secure_channel(
                self.endpoint, grpc.ssl_channel_credentials(root_certificates=ca), options)
        else:
            self._channel = grpc.insecure_channel(self.endpoint, options)
        self._call = self._channel.stream_stream(f"/{SERVICE}/Call")
        self._capabilities = self._channel.unary_unary(f"/{SERVICE}/Capabilities")
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self.session = uuid.uuid4().hex
        self._served: Capabilities | None = None
        self.calls = 0

    # -- RemoteTier --------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        if self._served is None:
            self._served = self._ask("connect")
        return self._served

    def _ask(self, op: str) -> Capabilities:
        """What the server serves now (not the answer kept from the first time)."""
        if self.config.on_failure == "wait":
            self.wait_until_healthy(self.config.wait_s)
        try:
            raw = self._capabilities(b"", timeout=self.config.deadline_s,
                                     metadata=self._metadata)
        except grpc.RpcError as exc:
            raise self._error(op, None, exc, 1, 0.0) from None
        info = json.loads(raw)
        return Capabilities(
            module=info["module"], device=info["device"], torch=info["torch"],
            parameters={k: tuple(v) for k, v in info["parameters"].items()},
            buffers={k: tuple(v) for k, v in info["buffers"].items()})

    def _check_served(self, op: str, step: int | None) -> None:
        """After the server forgot this session (it restarted, or another took its port):
        refuse a server that serves another module than the one this tier started with."""
        if self._served is None:
            return
        now, then = self._ask(op), self._served
        if (now.module, now.parameters, now.buffers) != (then.module, then.parameters,
                                                          then.buffers):
            raise RemoteTierError(
                f"{self._where(op, step)}: the server now serves {now.module}"
                + (" with other parameters" if now.module == then.module else "")
                + f", not {then.module} which this run started with (it was "
                "replaced: serve the same module there again, or start the run anew)")

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(service=SERVICE),
                                       timeout=timeout)
        except grpc.RpcError:
            return False
        return cast(bool, reply.status == health_pb2.HealthCheckResponse.SERVING)

    def call(self, op: str, tensors: dict[str, torch.Tensor], *, meta: dict[str, Any],
             step: int | None, deadline_s: float | None = None
             ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        deadline = time.monotonic() + (deadline_s or self.config.deadline_s)
        header = {**meta, "op": op, "session": self.session, "step": step,
                  "request_id": uuid.uuid4().hex}
        if self._served is not None:  # the server refuses a call made for another module
            header["module"] = self._served.module
        self.calls += 1
        tries, started = 0, time.monotonic()
        while True:
            tries += 1
            left = deadline - time.monotonic()
            try:
                replies = self._call(wire.encode(header, tensors), timeout=max(left, 0.001),
                                     metadata=self._metadata)
                return wire.decode(replies, max_bytes=None)
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    # An unknown session, a lost forward, another module: the server may
                    # have been replaced since; whatever it is, not used without a check.
                    self._check_served(op, step)
                    if exc.details() == NEEDS_STATE:
                        raise NeedsState(exc.details()) from None
                pause = min(0.1 * 2 ** (tries - 1), 2.0)
                if (code in _RETRY and tries <= self.config.retries
                        and time.monotonic() + pause < deadline):
                    time.sleep(pause)
                    continue
                error = self._error(op, step, exc, tries, time.monotonic() - started)
            if self.config.on_failure == "wait" and code in _RETRY:
                back = self.wait_until_healthy(self.config.wait_s)
                error = RemoteTierError(f"{error}; " + (
                    "the server is back: the job can resume from its last checkpoint (give "
                    "it --max-restarts)" if back else
                    f"it did not come back within wait_s {self.config.wait_s:g} s"))
            raise error

    def state_dict(self) -> dict[str, Any]:
        served = self.capabilities()
        return {"endpoint": self.endpoint, "module": served.module}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        served = self.capabilities()
        if state.get("module") not in (None, served.module):
            raise RemoteTierError(f"remote tier {self.endpoint} serves {served.module}; the "
                                  f"checkpoint was trained with {state['module']}")

    def close(self) -> None:
        try:
            list(self._call(wire.encode({"op": "close", "session": self.session}, {}),
                            timeout=2.0, metadata=self._metadata))  # waited for: then closed
        except grpc.RpcError:
            pass  # the server forgets idle sessions on its own
        self._channel.close()

    # -- helpers -----------------------------------------------------------------------

    def wait_until_healthy(self, timeout: float) -> bool:
        """Poll the standard health service until SERVING or ``timeout`` seconds, saying
        so on stderr every ``WAIT_LINE_EVERY_S`` while it waits.

        Never raises.
        """
        start = time.monotonic()
        end, said = start + timeout, None
        while True:
            if self.healthy(timeout=min(2.0, max(end - time.monotonic(), 0.1))):
                return True
            now = time.monotonic()
            if now >= end:
                return False
            if said is None or now - said >= WAIT_LINE_EVERY_S:
                said = now
                print(f"shoal remote: waiting for the remote server at {self.endpoint} "
                      f"({now - start:.0f} s of on_failure 'wait' up to wait_s "
                      f"{timeout:g} s)", file=sys.stderr, flush=True)
            time.sleep(0.2)

    def _error(self, op: str, step: int | None, exc: grpc.RpcError, tries: int,
               seconds: float) -> RemoteTierError:
        code, details = exc.code(), exc.details()
        where = self._where(op, step)
        waits = self.config.on_failure == "fail"  # else the caller says how the wait went
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return RemoteTierError(f"{where} refused: {details} (check remote_hardware."
                                   "token_file / token_env against the server's "
                                   "--token-file)")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RemoteTierError(f"{where}: no reply within deadline_s "
                                   f"{self.config.deadline_s:g} s" + (
                                       " (raise it for a slow module; remote_hardware."
                                       "on_failure: wait waits for a server that restarts)"
                                       if waits else ""))
        if code == grpc.StatusCode.UNAVAILABLE:
            # The hint before gRPC's details: a summary line may cut what comes last.
            return RemoteTierError(f"{where}: the server is unreachable after {tries} "
                                   f"tr{'y' if tries == 1 else 'ies'} in {seconds:.1f} s" + (
                                       "; remote_hardware.on_failure: wait waits for it"
                                       if waits else "") + f" ({details})")
        return RemoteTierError(f"{where} failed on the server: {code.name}: {details}")

    def _where(self, op: str, step: int | None) -> str:
        return f"remote tier {self.endpoint}: {op}" + (f" of step {step}" if step else "")
