"""The manifest of a dataset, and the file operations that check a copy against it.

Rank 0 hashes SRC into a ``Manifest`` (sha256 of every chunk and of every file). On each
node, ``plan_file`` compares the copy under DEST with it and lists the chunks that differ or
are missing; ``open_part`` gets the copy ready as ``<file>.shoal-part``, ``write_chunk`` fills
in the chunks, and ``finish_file`` checks the whole file's sha256 before renaming it into
place. Everything here runs on one machine; ``shoal.data.replicate`` moves the chunks.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shoal.runtime.heartbeat import heartbeat

CHUNK_SIZE = 16 << 20
PART_SUFFIX = ".shoal-part"
_beats = itertools.count()


def beat() -> None:
    """Tell the launcher's hang watch that the copy moves on (one call per chunk)."""
    heartbeat(next(_beats))


class ReplicateError(RuntimeError):
    """Replication cannot finish; the message names the node and the file."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        # 2 for bad input (SRC missing, DEST not writable), as the CLI does; 1 otherwise.
        self.exit_code = exit_code


@dataclass(frozen=True)
class FileEntry:
    """One file of SRC, as the manifest describes it."""

    path: str
    """Relative to SRC, with '/' separators."""
    size: int
    sha256: str
    """Of the whole file."""
    chunks: tuple[str, ...]
    """sha256 of each chunk-size piece, in order; the last piece may be shorter."""
    mode: int
    """Permission bits, given to every copy."""

    def chunk_span(self, index: int, chunk_size: int) -> tuple[int, int]:
        """(offset, length) of chunk ``index``."""
        offset = index * chunk_size
        return offset, min(chunk_size, self.size - offset)


@dataclass(frozen=True)
class Manifest:
    """What SRC holds; rank 0 builds it and every node checks its copy against it."""

    chunk_size: int
    files: tuple[FileEntry, ...]
    dirs: tuple[str, ...] = ()
    """Directories under SRC (relative), so that empty ones are replicated too."""
    single_file: bool = False
    """SRC is one file: DEST is the copy's path, or a directory to put it in."""

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)


@dataclass(frozen=True)
class FilePlan:
    """What one node must do for one file of the manifest."""

    index: int
    """Position of the file in the manifest."""
    target: str
    """The copy's final path on this node."""
    needed: tuple[int, ...] = ()
    """Chunks to receive."""
    base: str | None = None
    """An existing copy (``target`` or its part file) whose matching chunks are kept."""
    done: bool = False
    """``target`` already holds the file (same size and sha256): nothing to do."""

    @property
    def part(self) -> str:
        return self.target + PART_SUFFIX


def _read_full(f: Any, view: memoryview) -> int:
    """Fill ``view`` from ``f`` (short only at the end of the file); bytes read."""
    total = 0
    while total < len(view):
        n = f.readinto(view[total:])
        if not n:
            break
        total += n
    return total


def file_digests(path: str, size: int, chunk_size: int, with_chunks: bool = True
                 ) -> tuple[str, list[str]]:
    """sha256 of the first ``size`` bytes of ``path`` and of each ``chunk_size`` piece of them.

    A file shorter than ``size`` hashes what it has: its last pieces then match nothing.
    Reads one chunk at a time, whatever the file's size.
    """
    whole, chunks = hashlib.sha256(), []
    buffer = memoryview(bytearray(min(chunk_size, max(size, 1))))
    with open(path, "rb", buffering=0) as f:
        for offset in range(0, size, chunk_size):
            n = _read_full(f, buffer[:min(chunk_size, size - offset)])
            whole.update(buffer[:n])
            if with_chunks:
                chunks.append(hashlib.sha256(buffer[:n]).hexdigest())
            beat()
            if n < min(chunk_size, size - offset):
                break
    return whole.hexdigest(), chunks


def build_manifest(src: str, chunk_size: int = CHUNK_SIZE,
                   exclude: str | None = None) -> Manifest:
    """Hash every file under ``src`` (or ``src`` itself, a file), leaving out ``exclude``
    (a copy that lies inside ``src``) and unfinished copies (``*.shoal-part``)."""
    if os.path.isfile(src):
        stat = os.stat(src)
        whole, chunks = file_digests(src, stat.st_size, chunk_size)
        entry = FileEntry(os.path.basename(src), stat.st_size, whole, tuple(chunks),
                          stat.st_mode & 0o777)
        return Manifest(chunk_size, (entry,), single_file=True)
    if not os.path.isdir(src):
        raise ReplicateError(f"SRC {src} does not exist on rank 0", exit_code=2)
    skip = os.path.realpath(exclude) if exclude else None
    files: list[FileEntry] = []
    dirs: list[str] = []
    for root, subdirs, names in os.walk(src):
        # Links to folders are not followed (they may loop, or lead out of SRC).
        subdirs[:] = sorted(d for d in subdirs if not os.path.islink(os.path.join(root, d))
                            and os.path.realpath(os.path.join(root, d)) != skip)
        rel_root = os.path.relpath(root, src)
        dirs.extend(_relative(rel_root, d) for d in subdirs)
        for name in sorted(names):
            path = os.path.join(root, name)
            if name.endswith(PART_SUFFIX) or not os.path.isfile(path):
                continue  # sockets, broken links
            stat = os.stat(path)
            whole, chunks = file_digests(path, stat.st_size, chunk_size)
            files.append(FileEntry(_relative(rel_root, name), stat.st_size, whole,
                                   tuple(chunks), stat.st_mode & 0o777))
    return Manifest(chunk_size, tuple(files), tuple(dirs))


def _relative(rel_root: str, name: str) -> str:
    return name if rel_root == "." else f"{rel_root.replace(os.sep, '/')}/{name}"


def targets(manifest: Manifest, dest: str) -> list[str]:
    """Where each file of the manifest goes under ``dest`` on this node."""
    if manifest.single_file:
        name = manifest.files[0].path
        inside = dest.endswith(os.sep) or os.path.isdir(dest)
        return [os.path.join(dest, name) if inside else dest]
    return [os.path.join(dest, *entry.path.split("/")) for entry in manifest.files]


def plan_file(entry: FileEntry, target: str, chunk_size: int, index: int = 0) -> FilePlan:
    """Compare this node's copy of ``entry`` with the manifest: done, or which chunks to get.

    Both the file in place and an unfinished part file are candidates to keep chunks from
    (a corrupted or truncated copy is repaired, an interrupted one resumed); the one that
    lacks fewer chunks is kept.
    """
    part = target + PART_SUFFIX
    best: tuple[str, tuple[int, ...]] | None = None
    for candidate in (part, target):
        if not os.path.isfile(candidate):
            continue
        whole, chunks = file_digests(candidate, entry.size, chunk_size)
        if candidate == target and whole == entry.sha256 \
                and os.path.getsize(target) == entry.size:
            return FilePlan(index, target, done=True)
        missing = tuple(i for i, digest in enumerate(entry.chunks)
                        if i >= len(chunks) or chunks[i] != digest)
        if best is None or len(missing) < len(best[1]):
            best = (candidate, missing)
    if best is None:
        return FilePlan(index, target, needed=tuple(range(len(entry.chunks))))
    return FilePlan(index, target, needed=best[1], base=best[0])


def open_part(plan: FilePlan, entry: FileEntry) -> None:
    """Make ``plan.part`` ready to receive: the kept copy, cut or grown to the file's size,
    its disk space reserved (so a full disk shows before any byte is sent)."""
    if plan.done:
        if os.path.exists(plan.part):
            os.remove(plan.part)  # left by an older copy; the file in place is right
        return
    os.makedirs(os.path.dirname(plan.target) or ".", exist_ok=True)
    if plan.base == plan.target:
        os.replace(plan.target, plan.part)  # it is wrong anyway; repair it out of the way
    elif plan.base is None:
        open(plan.part, "wb").close()
    # Private and writable until it is checked (a read-only SRC file gives a read-only copy).
    os.chmod(plan.part, 0o600)
    with open(plan.part, "r+b") as f:
        f.truncate(min(entry.size, os.fstat(f.fileno()).st_size))
        try:
            _reserve(f.fileno(), entry.size)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, plan.part) from None


def _reserve(fd: int, size: int) -> None:
    if size > 0 and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    os.ftruncate(fd, size)  # no preallocation here: a full disk shows when writing


def read_chunk(path: str, offset: int, view: memoryview) -> None:
    """Fill ``view`` with the bytes of ``path`` at ``offset``."""
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        if _read_full(f, view) < len(view):
            raise ReplicateError(f"SRC file {path} became shorter during the copy")


def write_chunk(path: str, offset: int, data: memoryview) -> None:
    """Write ``data`` at ``offset`` of ``path`` (an existing file)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        while data:
            n = os.pwrite(fd, data, offset)
            data, offset = data[n:], offset + n
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, path) from None  # name the file
    finally:
        os.close(fd)


def finish_file(plan: FilePlan, entry: FileEntry, chunk_size: int) -> None:
    """Check the part file against the manifest's sha256, then rename it into place.

    Raises ReplicateError naming the file and both hashes; the part file is kept, so that
    a rerun fetches only the chunks that differ.
    """
    whole, _ = file_digests(plan.part, entry.size, chunk_size, with_chunks=False)
    size = os.path.getsize(plan.part)
    if whole != entry.sha256 or size != entry.size:
        raise ReplicateError(f"{entry.path}: sha256 mismatch after writing {plan.part}: "
                             f"expected {entry.sha256}, got {whole} ({size} bytes)")
    os.chmod(plan.part, entry.mode)
    os.replace(plan.part, plan.target)


def copy_chunks(manifest: Manifest, sources: Sequence[str] | Mapping[int, str],
                parts: Mapping[int, str], chunks: set[tuple[int, int]]) -> None:
    """Copy the (file, chunk) pairs ``chunks`` from ``sources`` into the part files ``parts``
    on this machine, one chunk at a time."""
    buffer = memoryview(bytearray(manifest.chunk_size))
    for index, chunk in sorted(chunks):
        offset, length = manifest.files[index].chunk_span(chunk, manifest.chunk_size)
        read_chunk(sources[index], offset, buffer[:length])
        write_chunk(parts[index], offset, buffer[:length])
        beat()


def source_paths(manifest: Manifest, src: str) -> list[str]:
    """Where each file of the manifest is under SRC."""
    if manifest.single_file:
        return [src]
    return [os.path.join(src, *entry.path.split("/")) for entry in manifest.files]


def prepare_dest(manifest: Manifest, dest: str, where: str = "") -> list[FilePlan]:
    """Check that DEST is writable (``where``: " on node 1 (host)", for the message), make
    the manifest's folders, compare what DEST holds with the manifest and open the part
    files; the plans say which chunks are still needed."""
    paths = targets(manifest, dest)
    root = os.path.dirname(paths[0]) if manifest.single_file else dest
    try:
        os.makedirs(root, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".shoal-probe-", dir=root)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise ReplicateError(f"DEST {root} is not writable{where}: {exc.strerror or exc}",
                             exit_code=2) from None
    for directory in manifest.dirs:
        os.makedirs(os.path.join(dest, *directory.split("/")), exist_ok=True)
    plans = [plan_file(entry, path, manifest.chunk_size, index)
             for index, (entry, path) in enumerate(zip(manifest.files, paths, strict=True))]
    for plan in plans:
        open_part(plan, manifest.files[plan.index])
    return plans
