"""Each rank's output on the launcher's terminal, line by line, in the order it was written.

Every rank writes its stdout and stderr to its own two log files (the failure summary reads
them). torch's elastic agent would show them by following each file in a thread of its
own, so that a rank's stderr line could be shown ahead of a stdout line it wrote before.
``OutputRelay`` follows both files of every rank in one thread, every 20 ms while they grow;
when both of a rank's files grew since the last look, the one last written earlier is shown
first (exact when each got one line, as when a rank prints and then fails). A look costs a
``stat`` of each file and one of the next attempt's folder; the folders are listed again
only when a restart made that folder, or half a second on. While nothing is written the
thread sleeps until a file is (Linux's inotify), or a tenth of a second: the agent of each
replica group runs one, beside busy workers whose cores it would take a slice of at every
look. Each line gets its rank's
prefix (``[rank3]: ``, or torchrun's ``--log-line-prefix-template``) and goes to the
launcher's stream of the same name; a line still without its end is held until it ends or
the workers do.
"""

from __future__ import annotations

import ctypes
import glob
import os
import select
import socket
import string
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from shoal.launch.frames import PID_FILE

_INTERVAL_S = 0.02
_IDLE_S = 0.1  # the longest wait for a write (where inotify is there; else _INTERVAL_S)
_SCAN_S = 0.5  # the folders are listed again this often
_IN_MODIFY = 0x2  # (linux/inotify.h)
_STREAMS = ("stdout", "stderr")


class _File:
    """One log file, read from where the last look stopped."""

    def __init__(self, path: str):
        self.path, self.offset, self.partial = path, 0, b""

    def read(self) -> tuple[bytes, int]:
        """New whole lines, and the time the file was last written (ns)."""
        try:
            if os.stat(self.path).st_size == self.offset:
                return b"", 0
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
                mtime = os.fstat(f.fileno()).st_mtime_ns
        except OSError:
            return b"", 0
        self.offset += len(data)
        data = self.partial + data
        end = data.rfind(b"\n") + 1
        self.partial = data[end:]
        return data[:end], mtime

    def rest(self) -> bytes:
        """What is left at the end, the last line without its end included."""
        lines, _ = self.read()
        rest, self.partial = lines + self.partial, b""
        return rest + (b"\n" if rest and not rest.endswith(b"\n") else b"")


class _Writes:
    """Wakes a waiting thread when a file in a watched folder is written, or when ``wake``
    is called (Linux's inotify, through libc, and a pipe)."""

    def __init__(self, libc: ctypes.CDLL, fd: int):
        self._libc, self._fd = libc, fd
        self._wake_read, self._wake_write = os.pipe()
        self._watched: set[str] = set()
        self._poll = select.poll()
        for watched in (fd, self._wake_read):
            self._poll.register(watched, select.POLLIN)

    @classmethod
    def open(cls) -> _Writes | None:
        """None where inotify is not there (another system, or no instance left)."""
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError, TypeError):  # (no libc to load, no inotify in it)
            return None
        return cls(libc, fd) if fd >= 0 else None

    def watch(self, folder: str) -> None:
        """Wake at each write of a file in ``folder`` (where it cannot be watched, the wait's
        timeout finds its lines)."""
        if folder not in self._watched:
            self._watched.add(folder)
            self._libc.inotify_add_watch(self._fd, os.fsencode(folder), _IN_MODIFY)

    def wait(self, timeout: float) -> None:
        """Until a watched folder's file is written, ``wake``, or ``timeout`` seconds."""
        self._poll.poll(timeout * 1000)
        try:
            while os.read(self._fd, 4096):  # (the events: only that there were some counts)
                pass
        except BlockingIOError:
            pass

    def wake(self) -> None:
        os.write(self._wake_write, b"x")

    def close(self) -> None:
        for fd in (self._fd, self._wake_read, self._wake_write):
            os.close(fd)


def shoal_says() -> str:
    """How the launcher's own lines begin: ``shoal: ``, and in the launcher of a live job's
    replica group ``shoal: replica group G: `` (each group's launcher speaks of its own
    workers, and they all speak at once)."""
    # (shoal.ft.config's ENV_GROUP: not imported where the job is not live)
    group = os.environ.get("SHOAL_FT_GROUP")
    return "shoal: " if group is None else f"shoal: replica group {group}: "


class OutputRelay(threading.Thread):
    """Shows the lines of every rank of the newest attempt under ``log_dir``.

    ``shown(local_rank)`` says which streams of a rank are shown ("stdout", "stderr"), and
    ``first_rank`` is this node's first global rank (a worker names its own rank in the file
    beside its error file, which wins: under c10d rendezvous ranks are set when nodes meet).
    """

    def __init__(self, log_dir: str, shown: Callable[[int], set[str] | None],
                 first_rank: int = 0, out: TextIO | None = None, err: TextIO | None = None,
                 template: str = "[rank${rank}]: ", role: str = "default"):
        super().__init__(name="shoal-output", daemon=True)
        self.log_dir, self.shown, self.first_rank = log_dir, shown, first_rank
        self.template, self.role = template, role
        self.dest = {"stdout": out or sys.stdout, "stderr": err or sys.stderr}
        self._attempt: str | None = None
        self._files: dict[tuple[int, str], _File] = {}
        self._ranks: dict[int, int] = {}  # local rank -> global, once its worker has said
        self._scanned = -float("inf")  # when the folders were last listed (monotonic)
        self._halt = threading.Event()
        self._writes = _Writes.open()

    def run(self) -> None:
        shown = True
        while not self._halt.is_set():
            if shown or self._writes is None:  # a look every 20 ms while lines come
                self._halt.wait(_INTERVAL_S)
            else:  # none came at the last look: until a file is written
                self._writes.wait(_IDLE_S)
            if not self._halt.is_set():
                shown = self._look()

    def stop(self) -> None:
        """Show everything left, and stop."""
        self._halt.set()
        if self._writes is not None:
            self._writes.wake()
        self.join(timeout=5)
        self._look(final=True)
        if self._writes is not None and not self.is_alive():
            self._writes.close()
            self._writes = None

    def _look(self, final: bool = False) -> bool:
        """Show what the files got since the last look; whether there was any."""
        # Listed at each look until the ranks' folders are there, and as soon as a restart
        # makes the next attempt's (a rank's folder made after a listing, or an attempt
        # that skips a number, is found half a second on).
        if (final or not self._files or os.path.isdir(self._next_attempt())
                or time.monotonic() - self._scanned >= _SCAN_S):
            self._scanned = time.monotonic()
            self._scan()
        return self._relay(last=final)

    def _next_attempt(self) -> str:
        """The folder a restart makes next (torch's agent numbers attempts from 0)."""
        stem, _, number = (self._attempt or "").rpartition("_")
        return f"{stem}_{int(number) + 1}" if stem else ""

    def _scan(self) -> None:
        """The newest attempt's files (the attempt before, all of it first)."""
        attempts = glob.glob(os.path.join(self.log_dir, "*", "attempt_*"))
        newest = max(attempts, key=lambda p: int(p.rsplit("_", 1)[1]), default=None)
        if newest != self._attempt:
            self._relay(last=True)  # the attempt before: all of it first
            self._attempt, self._files, self._ranks = newest, {}, {}
        if newest is None:
            return
        for folder in glob.glob(os.path.join(newest, "*")):
            name = os.path.basename(folder)
            if not name.isdigit():
                continue
            for stream in self.shown(int(name)) or ():
                key = (int(name), stream)
                if key not in self._files:
                    self._files[key] = _File(os.path.join(folder, f"{stream}.log"))
                    if self._writes is not None:
                        self._writes.watch(folder)

    def _rank(self, local_rank: int) -> int:
        """The global rank, read once from the file the worker leaves (until then, or for a
        program started with --no-python, this node's first rank plus the local one)."""
        if local_rank in self._ranks:
            return self._ranks[local_rank]
        folder = os.path.join(self._attempt or "", str(local_rank))
        try:
            with open(os.path.join(folder, PID_FILE)) as f:
                self._ranks[local_rank] = int(f.read().split()[1])
                return self._ranks[local_rank]
        except (OSError, ValueError, IndexError):
            return self.first_rank + local_rank

    def _relay(self, last: bool) -> bool:
        shown = False
        ranks = sorted({rank for rank, _ in self._files})
        for local_rank in ranks:
            chunks = []
            for stream in _STREAMS:
                file = self._files.get((local_rank, stream))
                if file is None:
                    continue
                if last:
                    chunks.append((0, stream, file.rest()))
                else:
                    data, mtime = file.read()
                    chunks.append((mtime, stream, data))
            chunks = [chunk for chunk in chunks if chunk[2]]
            if not chunks:
                continue
            prefix = string.Template(self.template).safe_substitute(
                rank=self._rank(local_rank), local_rank=local_rank, role_name=self.role,
                hostname=socket.gethostname())
            # Both grew: the one written last earlier first (stdout first on a tie).
            for _, stream, data in sorted(chunks, key=lambda c: (c[0], c[1] == "stderr")):
                text = data.decode(errors="replace")
                dest = self.dest[stream]
                dest.write("".join(prefix + line for line in text.splitlines(keepends=True)))
                dest.flush()
                shown = True
        return shown
