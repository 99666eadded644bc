"""What the installed torch can do, asked once, here: the rest of shoal asks this module.

shoal supports a range of torch releases (see pyproject.toml). A feature that only some of
them have is found by looking for it (a dataclass field, a class, a keyword), never by
reading the version string, so a backport or a nightly gets what it really has.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable


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


def cheap_rendezvous_event_names() -> bool:
    """Make torch's c10d rendezvous name its events without ``inspect.stack()``.

    ``dynamic_rendezvous.get_method_name`` (every torch release shoal supports) builds the
    whole call stack with the source lines of every frame, twice, for each rendezvous event,
    only to read one function name: about a second of CPU in each launcher start. The same
    name is read from the frame directly. Returns whether the helper was found and replaced;
    a torch without it is left as it is.
    """
    import inspect
    import sys

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    original = getattr(dynamic_rendezvous, "get_method_name", None)
    if original is None or getattr(original, "_shoal", False):
        return original is not None
    if list(inspect.signature(original).parameters) != ["depth"]:
        return False  # not the helper this replaces

    def get_method_name(depth: int = 2) -> str:
        # inspect.stack()[depth] inside the helper is the frame ``depth`` levels up from it.
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:
            return "no_method_name"

    get_method_name._shoal = True  # type: ignore[attr-defined]
    dynamic_rendezvous.get_method_name = get_method_name
    return True


def rendezvous_join_delay(wanted: bool) -> bool:
    """Whether torch's c10d rendezvous waits its random 0 to 0.3 s before a node's first
    join (``dynamic_rendezvous._delay``, every torch release shoal supports), which spreads
    many nodes' joins over time. A job of one node has nothing to spread: shoal turns it off
    there, where it would only delay the start. Returns whether the helper was found."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    current = getattr(dynamic_rendezvous, "_delay", None)
    if current is None:
        return False
    original = getattr(current, "_shoal_original", current)
    if wanted:
        dynamic_rendezvous._delay = original
        return True

    def _delay(seconds: float | tuple[float, float]) -> None:
        if not isinstance(seconds, tuple):  # a fixed wait between retries stays
            original(seconds)

    _delay._shoal_original = original  # type: ignore[attr-defined]
    dynamic_rendezvous._delay = _delay
    return True


def worker_store_port(pick: Callable[[], int]) -> bool:
    """Where each attempt's workers get a store of their own (c10d rendezvous with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), the port that worker 0 is told to open comes
    from ``pick`` instead of torch's ``get_free_port`` (the OS's port 0: a port from the
    range every other program draws from too, while worker 0 binds it seconds later).
    Returns whether torch's helper was found."""
    from torch.distributed.elastic.rendezvous import api

    if not callable(getattr(api, "get_free_port", None)):
        return False
    api.get_free_port = pick
    return True
