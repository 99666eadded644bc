"""What the installed torch can do, asked once, here: the rest of shoal asks this module.

shoal supports a range of torch releases (see pyproject.toml). A feature that only some of
them have is found by looking for it (a dataclass field, a class, a keyword), never by
reading the version string, so a backport or a nightly gets what it really has.
"""

from __future__ import annotations

import dataclasses
import functools


@functools.cache
def launch_config_fields() -> frozenset[str]:
    """The fields of torch's ``LaunchConfig`` (torch.distributed.launcher.api)."""
    from torch.distributed.launcher.api import LaunchConfig

    return frozenset(f.name for f in dataclasses.fields(LaunchConfig))


def has_shutdown_grace() -> bool:
    """The elastic agent waits a configurable time between SIGTERM and SIGKILL when it stops
    workers (``LaunchConfig.shutdown_timeout``, torch 2.12 on); without it, torch's fixed
    default applies (30 s)."""
    return "shutdown_timeout" in launch_config_fields()


@functools.cache
def stager_reusable() -> bool:
    """DCP's ``DefaultStager`` can stage one save after another (torch 2.12 on). Before,
    a stager empties its copy table after its first save and fails on the second: a new
    one is needed per save, and its staging buffers are allocated anew each time."""
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=False,
                                          use_non_blocking_copy=False))
    try:
        for _ in range(2):
            stager.stage({"probe": torch.zeros(1)})
        return True
    except Exception:  # noqa: BLE001 - any failure of the second stage means "not reusable"
        return False
    finally:
        stager.close()
