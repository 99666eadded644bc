"""The remote hardware tier: part of a model runs on another machine's accelerator."""

from shoal.remote.client import GrpcRemoteTier
from shoal.remote.module import RemoteModule, remote_modules
from shoal.remote.tier import (
    Capabilities,
    RemoteConfig,
    RemoteTier,
    RemoteTierError,
    current,
    load_tier,
    using,
)

__all__ = ["Capabilities", "GrpcRemoteTier", "RemoteConfig", "RemoteModule", "RemoteTier",
           "RemoteTierError", "current", "load_tier", "remote_modules", "using"]
