"""New complete lines of a growing file, read from a byte offset.

A file is never read twice: each read starts where the last complete line ended, and a
last line without its newline (the writer is in the middle of it) is held back until it is
whole. A line longer than ``MAX_LINE`` is no record anyone wrote: it is skipped (and
counted) rather than held in memory however long it grows.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

CHUNK = 16 << 20
MAX_LINE = 64 << 20  # a step line of shoal's is well under 1 KB, one of 10,000 ranks ~1 MB


class LineTail:
    """Complete lines of ``path`` appended since the last read."""

    def __init__(self, path: str | os.PathLike, offset: int = 0):
        self.path = os.fspath(path)
        self.offset = offset
        self.size = 0  # the file's size at the last look
        self.replaced = False  # the file shrank: it was replaced, and is read from the start
        self.skipped = 0  # lines longer than MAX_LINE, skipped
        self._skipping = False  # in the middle of such a line: read on to its end

    def grew(self) -> bool:
        """Whether the file holds bytes past the offset (one stat, no read)."""
        try:
            self.size = os.stat(self.path).st_size
        except FileNotFoundError:
            return False
        if self.size < self.offset:
            self.offset, self.replaced, self._skipping = 0, True, False
        return self.size > self.offset

    def lines(self) -> Iterator[bytes]:
        """Every complete line from the offset to the end of the file, without its newline."""
        for block in self.blocks():
            yield from bytes(block).split(b"\n")

    def blocks(self) -> Iterator[memoryview]:
        """The complete lines from the offset on, a chunk of them at a time, without the
        last newline; the offset moves past each block as it is handed out.

        Each block is a view of one buffer that the next block overwrites: copy what is
        kept (a line is copied by ``bytes(block[a:b])``)."""
        if not self.grew():
            return
        buffer = bytearray(min(CHUNK, max(self.size - self.offset, 1 << 16)))
        view, held = memoryview(buffer), 0  # held: the start of a line not yet whole
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.offset)
            while n := f.readinto(view[held:]):
                n += held
                if self._skipping:  # the rest of an overlong line: up to its newline
                    done = buffer.find(b"\n", 0, n)
                    if done < 0:
                        self.offset, held = self.offset + n, 0
                        continue
                    self.offset += done + 1
                    self._skipping = False
                    n -= done + 1
                    buffer[:n] = buffer[done + 1:done + 1 + n]  # what follows it, read on
                end = buffer.rfind(b"\n", 0, n)
                if end < 0:  # not one whole line in the buffer
                    held = n
                    if held >= MAX_LINE:  # no record: skipped, not held
                        self.offset += held
                        held, self._skipping = 0, True
                        self.skipped += 1
                    elif held == len(buffer):  # a line longer than the buffer: make room
                        buffer = buffer + bytes(len(buffer))
                        view = memoryview(buffer)
                    continue
                self.offset += end + 1
                yield view[:end]
                held = n - end - 1
                buffer[:held] = buffer[end + 1:n]  # same size: the views stay valid
