"""Process groups that a worker's script destroys, held until the worker ends.

A torchrun script ends with ``dist.destroy_process_group()`` while its DDP model lives on,
in its globals or in the locals of the ``main()`` it returns from. The model's reducer then
holds the last reference to the group, and freeing the model frees the group there, in
C++, with the GIL held: the group's destructor waits for gloo's threads, and one of them
may need the GIL to free the last all-reduce's work (which holds the autograd engine's
context). The process hangs after the script's last line, now and then (about 1 run in 20
of such a script under ``shoal run --replica-groups 2``, whose workers are forked).

``hold_destroyed_groups`` wraps torch's ``destroy_process_group`` so that it keeps every
group it destroys; ``let_go`` drops them at the worker's end, from Python, whose binding of
a process group releases the GIL while gloo's threads end. A group is then never freed by
a reducer. (A script that makes and destroys many groups holds them all until it ends.)
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_C10D = "torch.distributed.distributed_c10d"
_held: list[Any] = []


def hold_destroyed_groups() -> None:
    """From now on, every process group destroyed in this process is held (``let_go``):
    at once where torch is imported, else as soon as it is (torch is not imported here for
    it: a worker started as a command imports it when the script does)."""
    c10d = sys.modules.get(_C10D)
    if c10d is not None:
        _wrap(c10d)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def let_go() -> None:
    """Drop the groups held (each one's destructor runs here, the GIL released, where
    nothing else holds it)."""
    _held.clear()


def held() -> list[Any]:
    return list(_held)


def _wrap(c10d: Any) -> None:
    original = getattr(c10d, "destroy_process_group", None)
    members = getattr(c10d, "GroupMember", None)
    world: Any = getattr(c10d, "_world", None)
    if original is None or getattr(original, "_shoal", False) or members is None \
            or not hasattr(world, "pg_map"):
        return  # a torch without what this reads: left as it is

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        if group is None or group == members.WORLD:
            _held.extend(world.pg_map)  # every group goes with the default one
        elif group != members.NON_GROUP_MEMBER:
            _held.append(group)
        original(group)

    destroy_process_group._shoal = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group
    dist: Any = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "destroy_process_group", None) is original:
        dist.destroy_process_group = destroy_process_group


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps torch's function as its module is imported (before ``torch.distributed``
    takes its names from it)."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if name != _C10D:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _wrap(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
