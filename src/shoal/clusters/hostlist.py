"""SLURM's compressed lists: hosts ('node[001-004,007],gpu-a[1-2]') and tasks ('4(x2),3').

Both raise ValueError on malformed text; the caller names the variable it came from.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")

# A host name is literal text and bracket groups: 'rack[1-2]-n[01-02]' is
# ['rack', [(1, 2, 1)], '-n', [(1, 2, 2)]], each range (first, last, digits).
_Part = str | list[tuple[int, int, int]]


def _split_names(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    names, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested '['")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("']' without '['")
        elif char == "," and depth == 0:
            names.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("'[' without ']'")
    names.append(text[start:])
    if any(not name.strip() for name in names):
        raise ValueError("empty host name")
    return names


def _parse_group(body: str) -> list[tuple[int, int, int]]:
    ranges = []
    for item in body.split(","):
        match = _RANGE.fullmatch(item.strip())
        if match is None:
            raise ValueError(f"bad range {item!r} (expected N or N-M)")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise ValueError(f"range {item!r} runs backwards")
        # SLURM keeps the zero padding of the first number: node[001-010] is node001..node010.
        ranges.append((int(first), int(last), len(first)))
    return ranges


def _parse_name(name: str) -> list[_Part]:
    parts: list[_Part] = []
    for piece in re.split(r"(\[[^\]]*\])", name.strip()):
        if piece.startswith("["):
            parts.append(_parse_group(piece[1:-1]))
        elif piece:
            parts.append(piece)
    return parts


def _expand(parts: list[_Part]) -> Iterator[str]:
    """Every host of one name, lazily: node[1-100000] is never held in memory."""
    if not parts:
        yield ""
        return
    head, rest = parts[0], parts[1:]
    if isinstance(head, str):
        values: Iterator[str] = iter([head])
    else:
        values = (str(n).zfill(width) for first, last, width in head
                  for n in range(first, last + 1))
    for value in values:
        for tail in _expand(rest):
            yield value + tail


def expand_hostlist(text: str) -> Iterator[str]:
    """The hosts of a SLURM host list, in order; the whole text is checked first."""
    parsed = [_parse_name(name) for name in _split_names(text.strip())]
    return (host for parts in parsed for host in _expand(parts))


def first_host(text: str) -> str:
    """The first host of a SLURM host list: 'rack[1-2]-n[01-02]' gives 'rack1-n01'."""
    return next(expand_hostlist(text))


def expand_tasks_per_node(text: str) -> list[int]:
    """Tasks on each node, in node order: '4(x2),3' gives [4, 4, 3]."""
    counts: list[int] = []
    for item in text.strip().split(","):
        match = _TASKS.fullmatch(item.strip())
        if match is None:
            raise ValueError(f"bad item {item!r} (expected N or N(xM))")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts
