"""A directory of checkpoints: DCP shards written by every rank, committed by rank 0.

Layout: ``ROOT/step_000000120/`` holds DCP's shard files and ``.metadata``, shoal's
``shoal.json`` (structure, counters) and, written last, ``COMMIT.json``, which lists every
file with its size. A save goes to ``step_N.partial`` and is renamed only after the commit
marker exists, so a crash mid-save never leaves a checkpoint that looks complete; a truncated
or missing shard is caught by the sizes before anything is loaded. Where several writers may
save one step at once (live replica groups), each has a partial directory of its own
(``step_N.partial.<writer>``), and the first to commit the step keeps it.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from shoal.checkpoint import layout, tree
from shoal.checkpoint.layout import COMMIT, META, OWN_DIR, STEP_DIR
from shoal.runtime.compat import stager_reusable


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with what is wrong and where."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointStore:
    """Save and find checkpoints under ``root``; keeps the newest ``keep_last`` (and the
    steps in ``kept``)."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 3, async_save: bool = False,
                 writer: str = ""):
        """``writer``: this one's name where several may save the same step at once (live
        replica groups stopped while they wait for each other hold the same state): each
        writes in a partial directory of its own, and of a step committed while this one
        saved it, the first commit stays."""
        self.root = Path(root)
        self.writer = writer
        self._started = 0.0  # (wall clock) when the save in flight began
        self.keep_last = keep_last
        self.async_save = async_save
        self._pending: tuple[Any, Path, dict] | None = None  # (future, partial dir, record)
        self._stager: DefaultStager | None = None
        self._cpu_group: dist.ProcessGroup | None = None
        self.kept: set[int] = set()
        """Steps kept beside the newest ``keep_last`` (the best ones, ``BestCheckpoints``)."""

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:09d}"

    # -- saving ---------------------------------------------------------------------------

    def save(self, step: int, shared: dict, own: dict, meta: dict) -> Path:
        """Write a checkpoint (collective: every rank calls it).

        ``shared`` is the same on every rank (model, optimizer, ...); DCP writes each
        replicated tensor once. ``own`` is this rank's alone (its RNG states). ``meta`` is
        JSON data (counters, config) recorded by rank 0. With ``async_save`` this returns
        once the tensors are copied; the files are written in the background and committed
        by the next ``save`` or by ``wait``.
        """
        self.wait()
        self._started = time.time()
        rank = _rank()
        final = self.path_for(step)
        partial = final.with_name(final.name + ".partial" + (f".{self.writer}" if self.writer
                                                             else ""))
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash during a save
            partial.mkdir(parents=True)
        _barrier()
        skeleton, tensors = tree.split(shared, "shared")
        own_skeleton, own_tensors = tree.split(own, f"rank{rank}")
        own_skeletons = [own_skeleton]
        if dist.is_initialized():
            # Shared state may be held in parts (pipeline stages): its skeleton is the union.
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (skeleton, own_skeleton))
            skeleton = functools.reduce(tree.merge, [s for s, _ in gathered])
            own_skeletons = [o for _, o in gathered]
        world = dist.get_world_size() if dist.is_initialized() else 1
        record = {"step": step, "world_size": world, "meta": meta, "shared": skeleton,
                  "ranks": own_skeletons}
        state = {**tensors, **own_tensors}
        if self.async_save:
            # Detached views: the stager deep-copies a tensor's Python attributes too, and
            # a parameter may carry a wrapper's bookkeeping there.
            state = {k: v.detach() for k, v in state.items()}
            future = dcp.async_save(state, checkpoint_id=str(partial),
                                    async_stager=self._staging_buffers(),
                                    process_group=self._async_group())
            self._pending = (future, partial, record)
            return final
        dcp.save(state, checkpoint_id=str(partial))
        self._commit(partial, record)
        return final

    def _staging_buffers(self) -> DefaultStager:
        """One stager for the store's life: its copy buffers (pinned on a GPU machine) are
        reused from save to save, so after the first save a step waits only for a memory
        copy (at the price of a second copy of the state kept in memory). The copy completes
        before save returns, so training may change the weights right after. A torch whose
        stager cannot stage twice gets a new one per save."""
        if self._stager is not None and not stager_reusable():
            self._stager.close()
            self._stager = None
        if self._stager is None:
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                use_non_blocking_copy=cuda))
        return self._stager

    def _async_group(self) -> dist.ProcessGroup | None:
        """A process group with a CPU side for the background writer (collective, once).

        DCP's async save coordinates its ranks on the CPU while training goes on; a plain
        NCCL group has no CPU side, so under NCCL a gloo group of the same ranks does it.
        """
        if not dist.is_initialized() or "gloo" in str(dist.get_backend()):
            return None
        if self._cpu_group is None:
            self._cpu_group = dist.new_group(backend="gloo")
        return self._cpu_group

    def wait(self) -> None:
        """Finish and commit an asynchronous save in flight (collective); no-op otherwise."""
        if self._pending is None:
            return
        future, partial, record = self._pending
        self._pending = None
        future.result()
        self._commit(partial, record)

    def _commit(self, partial: Path, record: dict) -> None:
        # Every rank's shards are written before rank 0 writes the marker.
        _barrier()
        if _rank() == 0:
            final = self.path_for(record["step"])
            _write_json(partial / META, record)
            files = {p.name: p.stat().st_size for p in sorted(partial.iterdir())}
            _write_json(partial / COMMIT, {"step": record["step"], "files": files})
            if self.writer and self.committed_since(record["step"], self._started):
                shutil.rmtree(partial, ignore_errors=True)
            else:  # (a step saved again: the new save replaces the one there)
                shutil.rmtree(final, ignore_errors=True)
                try:
                    os.replace(partial, final)
                except OSError:
                    if not self.committed_since(record["step"], self._started):
                        raise
                    shutil.rmtree(partial, ignore_errors=True)
            self._prune()
        _barrier()

    def committed_since(self, step: int, since: float) -> bool:
        """A complete checkpoint of ``step`` was committed at or after ``since`` (wall
        clock): another writer's, where several hold the same state at a step (this one
        need not save it, or keeps the first commit)."""
        final = self.path_for(step)
        try:
            committed = final.stat().st_mtime  # (its last entry: the commit marker)
        except FileNotFoundError:
            return False
        return committed >= since and self.problem(final) is None

    def _prune(self) -> None:
        committed = self._step_dirs()
        for path in committed[:-self.keep_last] if self.keep_last > 0 else []:
            if int(cast("re.Match[str]", STEP_DIR.match(path.name)).group(1)) not in self.kept:
                shutil.rmtree(path, ignore_errors=True)
        kept = {int(cast("re.Match[str]", STEP_DIR.match(p.name)).group(1))
                for p in self._step_dirs()}
        newest = max(kept, default=-1)
        for path in self.root.glob("step_*.group*"):  # a pruned step's groups' parts go too
            found = OWN_DIR.match(path.name)
            if found and int(found.group(1)) not in kept and int(found.group(1)) < newest:
                shutil.rmtree(path, ignore_errors=True)

    # -- a live job's groups: each one's own part of a step --------------------------------

    def own_path(self, step: int, group: int) -> Path:
        """Where replica group ``group`` keeps its ranks' own parts of step ``step``."""
        return self.root / f"step_{step:09d}.group{group}"

    def save_own(self, step: int, group: int, own: dict) -> None:
        """This rank's own part of step ``step`` (what ``save`` files under ``own``), as
        replica group ``group`` holds it: a live job's groups that do not write the
        checkpoint each keep theirs (error feedback, a replica of their own), so that every
        group resumes from the step with its own. Written whole or not at all."""
        folder = self.own_path(step, group)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{_rank()}.pt"
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        torch.save(own, partial)
        os.replace(partial, path)

    def load_own(self, path: str | os.PathLike, group: int) -> dict | None:
        """This rank's own part of the checkpoint at ``path`` as replica group ``group``
        kept it (``save_own``; the checkpoint's own where ``group`` wrote it), or None where
        it has none. Not collective: the group's other ranks may not be loading."""
        path = Path(path)
        found = STEP_DIR.match(path.name)
        if found is None:
            return None
        info = read_info(path)
        if info is not None and info["meta"].get("group") == group:
            return _rank_part(path, info)
        own = self.own_path(int(found.group(1)), group) / f"rank{_rank()}.pt"
        try:
            return torch.load(own, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            return None

    # -- finding ----------------------------------------------------------------------------

    def _step_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
        return sorted(found, key=lambda p: int(
            cast("re.Match[str]", STEP_DIR.match(p.name)).group(1)))  # matched above

    @staticmethod
    def problem(path: Path) -> str | None:
        """What makes ``path`` unusable, or None when it is complete."""
        return layout.problem(path)

    def latest(self, report: bool = True, whole: Callable[[Path], bool] | None = None
               ) -> Path | None:
        """The newest complete checkpoint; skipped broken ones are named on rank 0.
        ``whole(path)``: it must also say so of the one taken (where none does, the newest
        complete one)."""
        complete = []
        for path in reversed(self._step_dirs()):
            problem = self.problem(path)
            if problem is None:
                if whole is None or whole(path):
                    return path
                complete.append(path)
            elif report and _rank() == 0:
                print(f"shoal: skipping checkpoint {path}: {problem}", file=sys.stderr,
                      flush=True)
        return complete[0] if complete else None

    def has_own(self, path: Path, ranks: int) -> bool:
        """Every live group but the one that wrote the checkpoint at ``path`` kept its own
        part of it, for each of its ``ranks`` ranks (``save_own``; True outside live
        mode)."""
        found = STEP_DIR.match(path.name)
        info = json.loads((path / META).read_text())
        writer, groups = info["meta"].get("group"), info["meta"].get("groups")
        if found is None or writer is None or groups is None:
            return True
        step = int(found.group(1))
        return all((self.own_path(step, group) / f"rank{rank}.pt").is_file()
                   for group in range(groups) if group != writer for rank in range(ranks))

    # -- loading ----------------------------------------------------------------------------

    def load(self, path: str | os.PathLike, like: dict[str, torch.Tensor] | None = None,
             skip: Callable[[str], bool] | None = None) -> tuple[dict, dict | None, dict]:
        """(shared state, this rank's own state or None, meta) of the checkpoint at ``path``.

        Collective. Tensors are allocated from the checkpoint's own metadata and filled by
        DCP; nothing is unpickled. ``like`` maps keys to tensors to load into instead, of
        the same global shape and dtype: DTensors get only this rank's shard, whatever the
        layout the checkpoint was saved in. Tensors whose key ``skip`` accepts are not read
        (None in the state): another pipeline stage's, say.
        """
        path = Path(path)
        problem = self.problem(path)
        if problem is not None:
            raise CheckpointError(f"checkpoint {path} cannot be loaded: {problem}")
        info = json.loads((path / META).read_text())
        rank = _rank()
        own_skeleton = info["ranks"][rank] if rank < len(info["ranks"]) else None
        keys = tree.tensor_keys(info["shared"])
        if own_skeleton is not None:
            keys += tree.tensor_keys(own_skeleton)
        tensors = tensor_targets(path, [k for k in keys if skip is None or not skip(k)], like)
        dcp.load(tensors, checkpoint_id=str(path))
        shared = tree.join(info["shared"], tensors)
        own = tree.join(own_skeleton, tensors) if own_skeleton is not None else None
        return shared, own, {**info["meta"], "world_size": info["world_size"],
                             "step": info["step"]}


def read_info(path: Path) -> dict | None:
    """The checkpoint's ``shoal.json`` (None: no such complete checkpoint)."""
    try:
        return json.loads((path / META).read_text())
    except (OSError, ValueError):
        return None


def tensor_targets(path: Path, keys: list[str], like: dict[str, torch.Tensor] | None = None
             ) -> dict[str, torch.Tensor]:
    """Tensors for DCP to load ``keys`` of the checkpoint at ``path`` into: ``like``'s where
    shape and dtype match, else empty ones shaped from the checkpoint's own metadata."""
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    tensors = {}
    for key in keys:
        entry = stored.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {path}: tensor {key!r} is missing")
        target = (like or {}).get(key)
        if target is not None and target.shape == entry.size \
                and target.dtype == entry.properties.dtype:
            tensors[key] = target
        else:
            tensors[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    return tensors


def _rank_part(path: Path, info: dict) -> dict | None:
    """This rank's own part of the checkpoint at ``path`` (``info``: its ``shoal.json``),
    read by this process alone."""
    rank = _rank()
    skeleton = info["ranks"][rank] if rank < len(info["ranks"]) else None
    if skeleton is None:
        return None
    tensors = tensor_targets(path, tree.tensor_keys(skeleton))
    dcp.load(tensors, checkpoint_id=str(path), no_dist=True)
    return tree.join(skeleton, tensors)
