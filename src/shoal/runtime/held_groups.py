"""Process groups that a worker's script destroys, held until the worker ends.

A torchrun script ends with ``dist.destroy_process_group()`` while its DDP model lives on,
in its globals or in the locals of the ``main()`` it returns from. The model's reducer then
holds the last reference to the group, and freeing the model frees the group there, in
C++, with the GIL held: the group's destructor waits for gloo's threads, and one of them
may need the GIL to free the last all-reduce's work (which holds the autograd engine's
context). The process hangs after the script's last line, now and then (about 1 run in 20
of such a script under ``shoal run --replica-groups 2``, whose workers are forked).

``hold_destroyed_groups`` wraps torch's ``destroy_process_group`` so that it keeps the
groups it destroys; ``let_go`` drops them at the worker's end, from Python, whose binding
of a process group releases the GIL while gloo's threads end. The groups are kept by
generation, each ending with a call that destroys them all (the default group): the end of
one lets the one before it go (their threads and sockets end there), so a script that sets
up and destroys its groups once an epoch holds one generation, and a model that outlives
the next one is freed as without shoal.
"""

from __future__ import annotations

import copy
import functools
import importlib.abc
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_C10D = "torch.distributed.distributed_c10d"
_held: list[list[Any]] = [[]]  # by generation, the last one under way


def hold_destroyed_groups() -> None:
    """From now on, the process groups destroyed in this process are held (``let_go``):
    at once where torch is imported, else as soon as it is (torch is not imported here for
    it: a worker started as a command imports it when the script does)."""
    c10d = sys.modules.get(_C10D)
    if c10d is not None:
        _wrap(c10d)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path = [_AfterImport(), *sys.meta_path]


def let_go() -> None:
    """Drop the groups held (each one's destructor runs here, the GIL released, where
    nothing else holds it)."""
    _held[:] = [[]]


def held() -> list[Any]:
    return [group for generation in _held for group in generation]


def _wrap(c10d: Any) -> None:
    original = getattr(c10d, "destroy_process_group", None)
    members = getattr(c10d, "GroupMember", None)
    world: Any = getattr(c10d, "_world", None)
    if original is None or getattr(original, "_shoal", False) or members is None \
            or not hasattr(world, "pg_map"):
        return  # a torch without what this reads: left as it is

    @functools.wraps(original)
    def destroy_process_group(group: Any = None, *args: Any, **kwargs: Any) -> Any:
        whole = group is None or group == members.WORLD
        going = list(world.pg_map) if whole else [group]  # (every group goes with WORLD)
        result = original(group, *args, **kwargs)
        if group != members.NON_GROUP_MEMBER:
            _held[-1].extend(going)
        if whole:  # a generation ends: the one before it goes
            _held[:] = [_held[-1], []]
        return result

    destroy_process_group._shoal = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group
    dist: Any = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "destroy_process_group", None) is original:
        dist.destroy_process_group = destroy_process_group


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps torch's function as its module is imported (before ``torch.distributed``
    takes its names from it): the other finders find the module, and its loader (a copy:
    one loader may serve a whole folder) wraps it once it has run."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if name != _C10D:
            return None
        sys.meta_path = [f for f in sys.meta_path if f is not self]  # (not changed in place)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        try:
            loader = copy.copy(spec.loader)
            run = loader.exec_module
        except Exception:  # noqa: BLE001 - a loader this cannot copy: left as it is
            return spec

        def exec_module(module: ModuleType) -> None:
            run(module)
            _wrap(module)

        loader.exec_module = exec_module
        spec.loader = loader
        return spec
