"""A text corpus that needs no download: the Python standard library's own source, as bytes.

Every machine with Python has it, and byte-level tokens (vocab 256) need no tokenizer. The
corpus depends on the Python version (3.11 and 3.12 ship different files), so runs compare
only on the same version; ``load_stdlib_corpus`` reports the files and bytes it used.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

# Test suites are large and repetitive; installed packages differ between machines.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                            "__pycache__"})
_SEPARATOR = b"\x00"  # between files; never appears in source text


@dataclass(frozen=True)
class TextCorpus:
    """The corpus as one byte tensor, and where it came from."""

    tokens: torch.Tensor
    """uint8 tensor of every byte, files joined by a NUL byte."""
    files: int
    """Source files read (the last one possibly cut at max_bytes)."""
    root: str
    """The standard library directory."""

    def describe(self) -> str:
        return f"{self.files} files, {len(self.tokens):,} bytes from {self.root}"


def _source_files(root: Path) -> list[Path]:
    """Every *.py under ``root`` outside excluded dirs, sorted by relative path."""
    found = [path for path in root.rglob("*.py")
             if not _EXCLUDED_DIRS.intersection(path.relative_to(root).parts[:-1])]
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


def load_stdlib_corpus(max_bytes: int | None = 4_000_000) -> TextCorpus:
    """The standard library's source, at most ``max_bytes`` bytes (None: all of it)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"the Python standard library is not at {root}: the text "
                                "corpus is built from its source files")
    chunks: list[bytes] = []
    size = 0
    for path in _source_files(root):
        if max_bytes is not None and size >= max_bytes:
            break
        chunk = path.read_bytes() + _SEPARATOR
        chunks.append(chunk)
        size += len(chunk)
    data = b"".join(chunks)[:max_bytes]
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)
    return TextCorpus(tokens, len(chunks), str(root))


class TokenWindows(Dataset):
    """Windows of ``seq_len`` tokens and the same window shifted by one (the targets).

    With ``causal_lm``, a window is ``{"input_ids": w, "labels": w}`` instead, as a
    transformers causal LM takes it (it shifts the labels itself). Holds a view of the
    corpus, not a copy; windows are cut when indexed.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, stride: int, start: int = 0,
                 causal_lm: bool = False):
        self.tokens = tokens
        self.seq_len = seq_len
        self.stride = stride
        self.start = start
        """Position of ``tokens[0]`` in the whole corpus."""
        self.causal_lm = causal_lm

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - self.seq_len - 1) // self.stride + 1)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | dict:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        begin = index * self.stride
        chunk = self.tokens[begin:begin + self.seq_len + 1].long()
        if self.causal_lm:
            return {"input_ids": chunk[:-1], "labels": chunk[:-1]}
        return chunk[:-1], chunk[1:]


def build_data(seq_len: int = 128, max_bytes: int | None = 4_000_000,
               val_fraction: float = 0.1, stride: int | None = None,
               causal_lm: bool = False) -> tuple[TokenWindows, TokenWindows]:
    """Train and validation windows of the standard library's source.

    Validation is the last ``val_fraction`` of the corpus, so no window of one split shares
    a byte with the other. ``stride`` (default ``seq_len``: windows do not overlap) is the
    step between window starts. ``causal_lm``: windows as ``{"input_ids", "labels"}``, for
    a transformers causal LM (see ``TokenWindows``).
    """
    if seq_len <= 0 or (stride is not None and stride <= 0):
        raise ValueError(f"seq_len ({seq_len}) and stride ({stride}) must be positive")
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    corpus = load_stdlib_corpus(max_bytes)
    tokens = corpus.tokens
    split = len(tokens) - int(len(tokens) * val_fraction)
    train = TokenWindows(tokens[:split], seq_len, stride or seq_len, causal_lm=causal_lm)
    val = TokenWindows(tokens[split:], seq_len, stride or seq_len, start=split,
                       causal_lm=causal_lm)
    if len(train) == 0 or len(val) == 0:
        raise ValueError(f"the corpus ({corpus.describe()}) is too small for one window of "
                         f"{seq_len + 1} bytes in both splits (val_fraction {val_fraction}): "
                         "raise max_bytes or lower seq_len")
    return train, val
