"""Copy a dataset from global rank 0's node to every node, over the job's process group.

For clusters without a shared filesystem. Rank 0 hashes SRC into a manifest (sha256 of every
chunk and of every file, see ``shoal.data.manifest``); each node compares it with what its
DEST already holds, and only the chunks that some node lacks are broadcast, once, to all of
them. Each node checks every file it wrote against the manifest before renaming it into
place, so an interrupted copy resumes where it stopped and a damaged one is repaired.

``python -m shoal.data.replicate SRC DEST`` is the worker that `shoal data replicate`
launches on every node; ``replicate`` is the same copy as a function.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shoal.data.manifest import (
    CHUNK_SIZE,
    FilePlan,
    Manifest,
    ReplicateError,
    beat,
    build_manifest,
    copy_chunks,
    finish_file,
    prepare_dest,
    read_chunk,
    source_paths,
    write_chunk,
)
from shoal.runtime import dist as shoal_dist

# All nodes check that none has failed after this many bytes, so that a full disk on one
# node stops the copy soon, not after the whole dataset went past.
_CHECK_EVERY = 256 << 20
# Rank 0 hashes all of SRC while the other nodes wait in a collective: on a large dataset
# that takes far longer than torch's default of 30 minutes. A dead peer still fails at once.
GROUP_TIMEOUT_S = 6 * 3600


@dataclass(frozen=True)
class Node:
    """A machine of the job, as messages name it."""

    rank: int
    """The node's rank (``--node-rank``)."""
    host: str

    def __str__(self) -> str:
        return f"node {self.rank} ({self.host})"


@dataclass
class NodeReport:
    """What one node did to its DEST."""

    node: Node
    dest: str
    written: list[int] = field(default_factory=list)
    """Manifest positions of the files written (copied, repaired or finished)."""
    up_to_date: int = 0
    """Files that were in place already (same size and sha256)."""
    fetched: int = 0
    """Bytes written: received, or on node 0 copied from SRC."""
    kept: int = 0
    """Bytes of chunks kept from an earlier, partial or damaged, copy."""
    holds_source: bool = False
    """Node 0's DEST is SRC itself."""
    seconds: float = 0.0
    """Time spent broadcasting chunks, as this node measured it."""

    def describe(self) -> str:
        if self.holds_source:
            return f"{self.node}: DEST {self.dest} is SRC: nothing to copy here"
        how = "copied from SRC" if self.node.rank == 0 else "received"
        return (f"{self.node}: wrote {len(self.written)} files to {self.dest} "
                f"({_mb(self.fetched)} MB {how}, {_mb(self.kept)} MB kept from an earlier "
                f"copy); {self.up_to_date} already up to date")


@dataclass
class Summary:
    """The whole job's replication; every node gets the same one."""

    files: int
    total_bytes: int
    copied: int
    """Files written on at least one node."""
    chunks_sent: int
    bytes_sent: int
    seconds: float
    """Time spent broadcasting chunks, as node 0 measured it."""
    nodes: list[NodeReport]
    this_node: int = 0
    """Position of this node's report in ``nodes``."""

    @property
    def skipped(self) -> int:
        return self.files - self.copied

    @property
    def mb_per_s(self) -> float:
        return self.bytes_sent / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def describe(self) -> str:
        line = (f"shoal data replicate: {self.files} files ({_mb(self.total_bytes)} MB) on "
                f"{len(self.nodes)} nodes: {self.copied} copied, {self.skipped} skipped; "
                f"sent {self.chunks_sent} chunks ({_mb(self.bytes_sent)} MB) in "
                f"{self.seconds:.1f} s ({self.mb_per_s:.1f} MB/s)")
        return line + ("; every node was up to date" if self.copied == 0 else "")


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f}"


@dataclass(frozen=True)
class _Failure:
    """A node's error, passed to the other nodes so that all stop together."""

    message: str
    exit_code: int = 1


class _Group:
    """The collectives ``replicate`` uses; without a process group, one node alone."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.active else 0
        self.size = dist.get_world_size(group) if self.active else 1

    def broadcast_object(self, obj: Any) -> Any:
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_async(self, tensor: torch.Tensor) -> dist.Work | None:
        if self.size == 1:
            return None
        return dist.broadcast(tensor, group=self.group, group_src=0, async_op=True)

    def agree(self, outcome: Any) -> list[Any]:
        """Every node's outcome; the same ReplicateError on every node when one failed."""
        outcomes = self.all_gather(outcome)
        failures = [o for o in outcomes if isinstance(o, _Failure)]
        if failures:
            raise ReplicateError("; ".join(f.message for f in failures),
                                 max(f.exit_code for f in failures))
        return outcomes


def _failure(exc: OSError, node: Node) -> _Failure:
    where = f"{exc.filename}: " if exc.filename else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return _Failure(f"disk full on {node}: {where}{exc.strerror}")
    return _Failure(f"{node}: {where}{exc.strerror or exc}")


def _same_place(src: str, dest: str) -> bool:
    if os.path.exists(dest) and os.path.exists(src):
        return os.path.samefile(src, dest)
    return os.path.realpath(src) == os.path.realpath(dest)


class _Transfer:
    """Broadcast the scheduled chunks from node 0, two in flight: while one travels, node 0
    reads the next and the receivers write the previous. Memory: two chunks."""

    def __init__(self, group: _Group, manifest: Manifest, node: Node,
                 sources: list[str] | None, parts: dict[int, str], wanted: set[tuple[int, int]]):
        self.group, self.manifest, self.node = group, manifest, node
        self.sources = sources  # node 0 reads SRC; the others receive
        self.parts, self.wanted = parts, wanted
        self.buffers = [torch.empty(manifest.chunk_size, dtype=torch.uint8) for _ in range(2)]
        self.in_flight: deque[tuple[Any, tuple[int, int], memoryview]] = deque()
        self.error: _Failure | None = None

    def run(self, schedule: list[tuple[int, int]]) -> int:
        """Move every chunk of ``schedule``; bytes sent. Raises when a node failed."""
        sent = unchecked = 0
        for k, (index, chunk) in enumerate(schedule):
            if len(self.in_flight) == len(self.buffers):
                self._settle()
            length = self.manifest.files[index].chunk_span(chunk, self.manifest.chunk_size)[1]
            tensor = self.buffers[k % len(self.buffers)][:length]
            # ignore: numpy's stub gives ndarray no __buffer__ before Python 3.12; it is a buffer
            view = memoryview(tensor.numpy())  # type: ignore[arg-type]
            if self.sources is not None:
                self._read(index, chunk, view)
            self.in_flight.append((self.group.broadcast_async(tensor), (index, chunk), view))
            sent, unchecked = sent + length, unchecked + length
            if unchecked >= _CHECK_EVERY:
                self._check()
                unchecked = 0
        self._check()
        return sent

    def _read(self, index: int, chunk: int, view: memoryview) -> None:
        assert self.sources is not None  # only node 0 reads, and it has the sources
        try:
            read_chunk(self.sources[index], chunk * self.manifest.chunk_size, view)
        except ReplicateError as exc:
            self.error = self.error or _Failure(str(exc))
        except OSError as exc:
            self.error = self.error or _failure(exc, self.node)

    def _settle(self) -> None:
        """Wait for the oldest chunk in flight and write it, if this node wants it."""
        work, (index, chunk), view = self.in_flight.popleft()
        if work is not None:
            work.wait()
        if (index, chunk) in self.wanted and self.error is None:
            try:
                write_chunk(self.parts[index], chunk * self.manifest.chunk_size, view)
            except OSError as exc:
                self.error = _failure(exc, self.node)
        beat()

    def _check(self) -> None:
        while self.in_flight:
            self._settle()
        self.group.agree(self.error)


def replicate(src: str, dest: str, group: dist.ProcessGroup | None = None, *,
              node: Node | None = None, chunk_size: int = CHUNK_SIZE) -> Summary:
    """Copy SRC on the node of ``group``'s rank 0 to DEST on every node of ``group``.

    ``group`` holds one process per node (node 0's first); with no process group at all,
    this process copies SRC to DEST alone. Files already in place (same size and sha256) are
    left alone; only the chunks some node lacks are sent. Raises ReplicateError, the same
    on every node, when any node fails.
    """
    group_ = _Group(group)
    node = node or Node(group_.rank, socket.gethostname())
    is_source = group_.rank == 0
    # 1. Node 0 describes SRC.
    manifest: Any = None
    if is_source:
        try:
            manifest = build_manifest(src, chunk_size, exclude=dest)
        except ReplicateError as exc:
            manifest = _Failure(str(exc), exc.exit_code)
        except OSError as exc:
            manifest = _failure(exc, node)
    manifest = group_.broadcast_object(manifest)
    if isinstance(manifest, _Failure):
        raise ReplicateError(manifest.message, manifest.exit_code)
    # 2. Every node compares its DEST with the manifest and says which chunks it lacks.
    report = NodeReport(node, dest, holds_source=is_source and _same_place(src, dest))
    plans: list[FilePlan] = []
    try:
        plans = [] if report.holds_source else prepare_dest(manifest, dest, f" on {node}")
        outcome: Any = {p.index: p.needed for p in plans if p.needed}
    except ReplicateError as exc:
        outcome = _Failure(str(exc), exc.exit_code)
    except OSError as exc:
        outcome = _failure(exc, node)
    needs = group_.agree(outcome)
    # 3. Node 0 broadcasts each chunk that at least one other node lacks, once.
    schedule = sorted({(index, chunk) for needed in needs[1:]
                       for index, chunks in needed.items() for chunk in chunks})
    wanted = {(index, chunk) for index, chunks in needs[group_.rank].items() for chunk in chunks}
    sources = source_paths(manifest, src) if is_source else None
    parts = {plan.index: plan.part for plan in plans}
    started = time.perf_counter()
    transfer = _Transfer(group_, manifest, node, sources, parts, wanted)
    sent = transfer.run(schedule)
    report.seconds = time.perf_counter() - started
    # 4. Every node checks each file it wrote and renames it into place.
    try:
        if is_source:
            assert sources is not None  # set on the source node
            copy_chunks(manifest, sources, parts, wanted - set(schedule))
        _finish(manifest, plans, report)
        outcome = report
    except ReplicateError as exc:
        outcome = _Failure(f"{node}: {exc}", exc.exit_code)
    except OSError as exc:
        outcome = _failure(exc, node)
    reports = group_.agree(outcome)
    return Summary(files=len(manifest.files), total_bytes=manifest.total_bytes,
                   copied=len({i for r in reports for i in r.written}),
                   chunks_sent=len(schedule), bytes_sent=sent, seconds=reports[0].seconds,
                   nodes=reports, this_node=group_.rank)


def _finish(manifest: Manifest, plans: list[FilePlan], report: NodeReport) -> None:
    """Check and rename every file this node wrote; one error naming all that are wrong."""
    wrong = []
    for plan in plans:
        entry = manifest.files[plan.index]
        if plan.done:
            report.up_to_date += 1
            continue
        try:
            finish_file(plan, entry, manifest.chunk_size)
        except ReplicateError as exc:
            wrong.append(str(exc))
            continue
        fetched = sum(entry.chunk_span(c, manifest.chunk_size)[1] for c in plan.needed)
        report.written.append(plan.index)
        report.fetched += fetched
        report.kept += entry.size - fetched
    if wrong:
        raise ReplicateError("; ".join(wrong))


# --- The worker that `shoal data replicate` launches on every node ------------------------


def _node_leaders(local_rank: int) -> list[int]:
    """Global ranks of each node's local rank 0 (global rank 0 among them)."""
    local_ranks: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(local_ranks, local_rank)
    return [rank for rank, local in enumerate(local_ranks) if local == 0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shoal.data.replicate",
                                     description="Worker of `shoal data replicate`.")
    parser.add_argument("src")
    parser.add_argument("dest")
    parser.add_argument("--chunk-mb", type=int, default=CHUNK_SIZE >> 20)
    args = parser.parse_args(argv)
    env = shoal_dist.init("gloo", timeout=GROUP_TIMEOUT_S)
    leaders = _node_leaders(env.local_rank)
    # Not every scheduler names the node (GROUP_RANK); its place among the leaders then.
    position = leaders.index(env.rank) if env.rank in leaders else -1
    node = Node(int(os.environ.get("GROUP_RANK", position)), socket.gethostname())
    group = dist.new_group(leaders, backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    code = 0
    if env.rank in leaders:
        try:
            summary = replicate(args.src, args.dest, group, node=node,
                                chunk_size=args.chunk_mb << 20)
        except ReplicateError as exc:
            print(f"shoal data replicate: error: {exc}", file=sys.stderr, flush=True)
            code = exc.exit_code
        else:
            print(summary.nodes[summary.this_node].describe(), flush=True)
            if env.rank == 0:
                print(summary.describe(), flush=True)
    # The node's other processes only wait; they learn how it ended and exit the same way.
    box = [code]
    dist.broadcast_object_list(box, src=0)
    return code or box[0]


if __name__ == "__main__":
    sys.exit(main())
