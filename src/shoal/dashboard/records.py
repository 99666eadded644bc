"""What a metrics.jsonl line must be for the dashboard to keep it.

A line is kept only when it is one JSON object, every number in it is finite, and each
field the dashboard reads (the server's alerts, the page's charts) has the type shoal
writes there. Anything else is a bad line: counted, shown nowhere, and never the reason
the poller or the page stops. Fields the dashboard does not read pass through as they are.

Only the lines that are kept are checked (a few thousand per run, however long it is):
the lines thinned out are not even parsed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

NONE = type(None)


def _not_finite(text: str):
    raise ValueError(f"{text} is not a number the page can show")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        _not_finite(text)
    return value


# NaN and Infinity are refused as they are read, and so is a literal too large for a float
# (1e999 would be read as inf). Checking each float as it is read costs less than looking
# for such literals in the line first (a search through every line's bytes).
_decoder = json.JSONDecoder(parse_constant=_not_finite, parse_float=_finite)

INT, NUMBER, TEXT = frozenset({int}), frozenset({int, float, NONE}), frozenset({str})
MAYBE_INT = frozenset({int, NONE})  # a bool is not an int here: type() is checked


class Schema:
    """The fields of one kind of record that the dashboard reads: for each, the types its
    value may have, or a function that checks it; and the fields that must be there.

    The fields checked by type are checked a set at a time (``frozenset.issuperset`` over
    the types of the values: a loop in C), so a step record costs about a microsecond."""

    def __init__(self, rules: dict[str, frozenset | Callable], required: tuple[str, ...] = ()):
        self.names, self.required = tuple(rules), frozenset(required)
        by_types: dict[frozenset, set[str]] = {}
        for name, rule in rules.items():
            if isinstance(rule, frozenset):
                by_types.setdefault(rule, set()).add(name)
        self.typed = [(types, frozenset(names)) for types, names in by_types.items()]
        self.checked = [(name, rule) for name, rule in rules.items()
                        if not isinstance(rule, frozenset)]

    def fits(self, record: dict) -> bool:
        keys = record.keys()
        if not keys >= self.required:
            return False
        for types, names in self.typed:
            if not types.issuperset(map(type, map(record.__getitem__, keys & names))):
                return False
        for name, rule in self.checked:  # a loop, not all(...): no generator to make
            if name in record and not rule(record[name]):
                return False
        return True


def _numbers(value) -> bool:
    return value is None or (type(value) is list and NUMBER.issuperset(map(type, value)))


def _number_map(value) -> bool:
    return value is None or (type(value) is dict and
                             NUMBER.issuperset(map(type, value.values())))


def _steps(value) -> bool:
    return type(value) is list and len(value) == 2 and INT.issuperset(map(type, value))


_ROW = Schema({"rank": INT, **dict.fromkeys(
    ("data", "compute", "comm", "optimizer", "other", "step", "cpu_percent", "rss_bytes",
     "gpu_util_percent", "gpu_memory_bytes"), NUMBER)}, ("rank",))
_STRAGGLER = Schema({"rank": INT, "phase": TEXT, "busy_s": NUMBER, "median_busy_s": NUMBER,
                     "phase_excess_s": NUMBER, "spread_s": NUMBER}, ("rank",))


def _rows(value) -> bool:
    return type(value) is list and all(type(row) is dict and _ROW.fits(row) for row in value)


def _straggler(value) -> bool:
    return value is None or (type(value) is dict and _STRAGGLER.fits(value))


# Per type: the fields that are read, and which of them must be there. Steps and
# validations are placed on the curves by their step; a window by its first and last.
SCHEMAS: dict[str, Schema] = {
    "step": Schema({"step": INT, "epoch": MAYBE_INT, "phases_s": _number_map,
                    "rank_step_s": _numbers, "rank_comm_s": _numbers,
                    **dict.fromkeys(("time", "loss", "lr", "grad_norm", "step_time_s",
                                     "samples_per_s", "tokens_per_s", "mfu", "comm_bytes",
                                     "episode_return"), NUMBER)}, ("step",)),
    "ranks": Schema({"steps": _steps, "time": NUMBER, "ranks": _rows,
                     "straggler": _straggler}, ("steps", "ranks")),
    "validation": Schema({"step": INT, "time": NUMBER, "val_loss": NUMBER,
                          "eval_return": NUMBER}, ("step",)),
    "event": Schema({"step": INT, "time": NUMBER, "kind": TEXT, "restart": MAYBE_INT,
                     "world_size": MAYBE_INT, "memory_limit_bytes": NUMBER}),
}
_OTHER = Schema({"step": INT}, ("step",))  # a type the dashboard does not show


def parse(line: bytes) -> dict | None:
    """The record of ``line``, or None when the dashboard cannot use it (a record of a type
    it does not show is kept when it says its step, as every record shoal writes does)."""
    try:
        record = _decoder.decode(line.decode())
    except (ValueError, RecursionError):  # not UTF-8, not JSON, too deep, not finite
        return None
    if not isinstance(record, dict):
        return None
    kind = record.get("type")
    schema = SCHEMAS.get(kind, _OTHER) if isinstance(kind, str) else _OTHER
    return record if schema.fits(record) else None
