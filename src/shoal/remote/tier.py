"""The remote tier: the interface a plugin implements, its settings, and the run's tier.

A run config names a plugin with ``remote_hardware.tier_plugin: "pkg.module:factory"``; the
factory is called with the validated ``RemoteConfig`` and returns an object with the methods
of ``RemoteTier``. The built-in ``shoal.remote:GrpcRemoteTier`` is the reference.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from shoal.data.serve import is_loopback
from shoal.errors import UsageError

MAX_TOKEN = 4096  # bytes: the token travels in every call's metadata (gRPC takes 8 KiB)


def check_token(token: str, where: str) -> str:
    """``token`` if it fits a call's metadata; else a UsageError naming ``where`` (the file
    or variable it came from) and its size."""
    size = len(token.encode())
    if size > MAX_TOKEN:
        raise UsageError(f"{where}: the token is {size:,} bytes; it travels in every call's "
                         f"metadata, which takes at most {MAX_TOKEN:,}")
    if not all(" " <= c <= "~" for c in token):
        raise UsageError(f"{where}: the token ({size:,} bytes) holds characters other than "
                         "printable ASCII, which a call's metadata cannot carry")
    return token


class RemoteTierError(RuntimeError):
    """A remote call failed; the message names the endpoint, the call and the step.

    Raised by a tier's ``call`` and ``capabilities`` (and so by ``RemoteModule`` and
    ``Trainer.fit``) when a call is refused, gets no reply within ``deadline_s``, finds the
    server unreachable, or finds it serving another module.
    """


class NeedsState(RemoteTierError):
    """The server holds no module state for this session (new, or the server restarted).

    Raised by ``GrpcRemoteTier.call`` for a forward that brings no state; ``RemoteModule``
    catches it and sends the forward again with its state.
    """


@dataclass(frozen=True)
class Capabilities:
    """What a remote tier serves: the module (by import path), where it runs, and the names,
    shapes and dtypes of its parameters and buffers (which the local stand-in must match).

    Never raises.
    """

    module: str
    device: str
    torch: str
    parameters: dict[str, tuple[list[int], str]] = field(default_factory=dict)
    buffers: dict[str, tuple[list[int], str]] = field(default_factory=dict)


@runtime_checkable
class RemoteTier(Protocol):
    """What ``RemoteModule`` needs of a remote tier.

    ``call`` runs one operation ('forward' or 'backward', see ``shoal.remote.module`` for
    the tensors each takes and gives) and returns within ``deadline_s`` or raises
    ``RemoteTierError``. ``state_dict`` is saved in every checkpoint and given back to
    ``load_state_dict`` on resume (a tier that keeps state of its own restores it there).

    Raises:
        RemoteTierError: From ``call`` when the call fails or misses ``deadline_s``
            (``NeedsState`` when the server holds no state for the session), and from
            ``capabilities`` or ``load_state_dict`` when the server cannot answer or serves
            another module.
    """

    endpoint: str

    def capabilities(self) -> Capabilities: ...

    def healthy(self) -> bool: ...

    def call(self, op: str, tensors: dict[str, torch.Tensor], *, meta: dict[str, Any],
             step: int | None, deadline_s: float | None = None
             ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def splits_parameters(strategy: str, tp: int, pp: int) -> str | None:
    """Why a RemoteModule cannot train under this layout (its parameters must stay whole
    on each rank), or None when it can."""
    if strategy in ("zero2", "fsdp") or tp > 1 or pp > 1:
        return (f"a RemoteModule's parameters stay whole on each rank: strategy '{strategy}' "
                f"with tp {tp} and pp {pp} would split them (use ddp, zero1, local_sgd or "
                "diloco, without tensor or pipeline parallelism)")
    return None


def is_loopback_endpoint(endpoint: str) -> bool:
    return is_loopback(endpoint.rpartition(":")[0].strip("[]"))


class RemoteConfig(BaseModel):
    """The ``remote_hardware:`` section of a run config.

    Raises:
        pydantic.ValidationError: If a setting is unknown or invalid: an endpoint not
            host:port, a tier_plugin not 'package.module:factory', both token_file and
            token_env, or a non-loopback endpoint without tls_ca or insecure (a run config's
            loader reports it as a one-line UsageError).
    """

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    endpoint: str
    """host:port of the remote tier's server (``shoal remote serve``)."""
    tier_plugin: str = "shoal.remote:GrpcRemoteTier"
    """Import path of a factory called with this section; returns the tier."""
    token_file: str | None = None
    """File whose first line is the bearer token the server checks."""
    token_env: str | None = None
    """Name of an environment variable holding the token (the token itself never goes in
    the config)."""
    tls_ca: str | None = None
    """PEM file of the server's certificate or of the CA that signed it: the connection is
    TLS and the server is verified. Required unless the endpoint is loopback or insecure."""
    tls_server_name: str | None = None
    """Name to verify the certificate against, when it differs from the endpoint's host."""
    insecure: bool = False
    """Allow plain text to a non-loopback endpoint (tensors and token readable on the way)."""
    deadline_s: float = Field(60.0, gt=0)
    """Every remote call returns within this many seconds or fails."""
    retries: int = Field(3, ge=0)
    """Tries again after a lost connection, with the same request id (the server answers a
    repeated id from its cache, so nothing runs twice)."""
    on_failure: Literal["fail", "wait"] = "fail"
    """When the server is unreachable: 'fail' at once; 'wait' up to wait_s for it to come
    back (at start, and before a failed call is reported, so that a restarted job finds it)."""
    wait_s: float = Field(60.0, gt=0)
    """How long on_failure 'wait' waits."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Further settings for a plugin of your own (the reference takes none)."""

    @model_validator(mode="after")
    def _checks(self) -> RemoteConfig:
        host, sep, port = self.endpoint.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"endpoint {self.endpoint!r} must look like host:port")
        module, sep, attr = self.tier_plugin.partition(":")
        if not sep or not module or not attr:
            raise ValueError("tier_plugin must look like 'package.module:factory'")
        if self.token_file and self.token_env:
            raise ValueError("give token_file or token_env, not both")
        if not (is_loopback_endpoint(self.endpoint) or self.tls_ca or self.insecure):
            raise ValueError(f"endpoint {self.endpoint} is not loopback: set tls_ca (the "
                             "server's certificate or its CA) so that the connection is "
                             "encrypted, or insecure: true to send in plain text")
        return self

    def token(self) -> str | None:
        """The bearer token from token_file or token_env (None when neither is set)."""
        if self.token_file:
            try:
                with open(self.token_file) as f:
                    token = f.readline().strip()
            except OSError as exc:
                raise UsageError(f"remote_hardware.token_file {self.token_file}: "
                                 f"{exc.strerror}") from None
            if not token:
                raise UsageError(f"remote_hardware.token_file {self.token_file} is empty")
            return check_token(token, f"remote_hardware.token_file {self.token_file}")
        if self.token_env:
            token = os.environ.get(self.token_env, "").strip()
            if not token:
                raise UsageError(f"remote_hardware.token_env: the environment variable "
                                 f"{self.token_env} is not set")
            return check_token(token, f"remote_hardware.token_env {self.token_env}")
        return None


def load_tier(config: RemoteConfig) -> RemoteTier:
    """The tier the plugin's factory builds from ``config``.

    Raises:
        UsageError: If ``tier_plugin`` cannot be imported, is not callable, needs an extra
            that is not installed, or returns an object that lacks a method of
            ``RemoteTier``; also the default tier's token and ``tls_ca`` problems (see
            ``GrpcRemoteTier``).
    """
    from shoal.imports import import_builder

    factory = import_builder(config.tier_plugin, "remote_hardware.tier_plugin")
    tier: RemoteTier = factory(config)
    missing = [name for name in ("endpoint", "capabilities", "healthy", "call", "state_dict",
                                 "load_state_dict", "close") if not hasattr(tier, name)]
    if missing:
        raise UsageError(f"remote_hardware.tier_plugin {config.tier_plugin} returned "
                         f"{type(tier).__name__}, which lacks {', '.join(missing)} of "
                         "shoal.remote.RemoteTier")
    return tier


def probe(config: RemoteConfig) -> str:
    """Ask the tier what it serves (waiting for it under on_failure 'wait'), before any
    worker starts; an unreachable server or a refused token is a UsageError."""
    tier = load_tier(config)
    try:
        served = tier.capabilities()
    except RemoteTierError as exc:
        raise UsageError(str(exc)) from None
    finally:
        tier.close()
    return f"remote tier {config.endpoint} serves {served.module} on {served.device}"


_current: RemoteTier | None = None


def current() -> RemoteTier:
    """The run's tier (from its ``remote_hardware`` section), for model builders.

    Raises:
        UsageError: If there is none: the run config has no ``remote_hardware`` section and
            no ``using`` block is open.
    """
    if _current is None:
        raise UsageError("no remote tier: give the run config a remote_hardware section, or "
                         "pass tier= to RemoteModule")
    return _current


@contextlib.contextmanager
def using(tier: RemoteTier) -> Iterator[RemoteTier]:
    """Make ``tier`` the one ``current()`` returns; closes it at the end.

    Never raises.
    """
    global _current
    previous, _current = _current, tier
    try:
        yield tier
    finally:
        _current = previous
        tier.close()
