"""The remote hardware tier: part of a model runs on another machine's accelerator.

The names below are imported on first use: the Trainer imports this package, and only the
gRPC tier (``GrpcRemoteTier``, the extra ``shoal[remote]``) needs gRPC.
"""

from __future__ import annotations

from shoal.lazy import lazy_names

_LAZY = {
    "GrpcRemoteTier": "shoal.remote.client",
    "RemoteModule": "shoal.remote.module",
    "remote_modules": "shoal.remote.module",
    "Capabilities": "shoal.remote.tier",
    "NeedsState": "shoal.remote.tier",
    "RemoteConfig": "shoal.remote.tier",
    "RemoteTier": "shoal.remote.tier",
    "RemoteTierError": "shoal.remote.tier",
    "current": "shoal.remote.tier",
    "load_tier": "shoal.remote.tier",
    "using": "shoal.remote.tier",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
