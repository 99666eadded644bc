"""New complete lines of a growing file, read from a byte offset.

A file is never read twice: each read starts where the last complete line ended, and a
last line without its newline (the writer is in the middle of it) is held back until it is
whole.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

CHUNK = 16 << 20


class LineTail:
    """Complete lines of ``path`` appended since the last read."""

    def __init__(self, path: str | os.PathLike, offset: int = 0):
        self.path = os.fspath(path)
        self.offset = offset
        self.size = 0  # the file's size at the last look
        self.replaced = False  # the file shrank: it was replaced, and is read from the start

    def grew(self) -> bool:
        """Whether the file holds bytes past the offset (one stat, no read)."""
        try:
            self.size = os.stat(self.path).st_size
        except FileNotFoundError:
            return False
        if self.size < self.offset:
            self.offset, self.replaced = 0, True
        return self.size > self.offset

    def lines(self) -> Iterator[bytes]:
        """Every complete line from the offset to the end of the file, without its newline."""
        for block in self.blocks():
            yield from block.split(b"\n")

    def blocks(self) -> Iterator[bytes]:
        """The complete lines from the offset on, a chunk of them at a time, without the
        last newline; the offset moves past each block as it is handed out."""
        if not self.grew():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            rest = b""
            while chunk := f.read(CHUNK):
                chunk = rest + chunk
                end = chunk.rfind(b"\n")
                if end < 0:
                    rest = chunk
                    continue
                rest = chunk[end + 1:]
                self.offset += end + 1
                yield chunk[:end]
