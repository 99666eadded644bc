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


def _not_finite(text: str):
    raise ValueError(f"{text} is not a number the page can show")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: read as inf
        _not_finite(text)
    return value


_decoder = json.JSONDecoder(parse_float=_finite, parse_constant=_not_finite)


def _int(value) -> bool:
    return type(value) is int  # bool is an int too, and not a step


def _number(value) -> bool:
    return type(value) is float or type(value) is int


def _maybe(check: Callable) -> Callable:
    return lambda value: value is None or check(value)


def _numbers(value) -> bool:
    return isinstance(value, list) and all(v is None or _number(v) for v in value)


def _number_map(value) -> bool:
    return isinstance(value, dict) and all(v is None or _number(v) for v in value.values())


def _text(value) -> bool:
    return isinstance(value, str)


def _steps(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(map(_int, value))


NUMBER, INT = _maybe(_number), _maybe(_int)

_ROW = {"rank": _int, "data": NUMBER, "compute": NUMBER, "comm": NUMBER, "optimizer": NUMBER,
        "other": NUMBER, "step": NUMBER, "cpu_percent": NUMBER, "rss_bytes": NUMBER,
        "gpu_util_percent": NUMBER, "gpu_memory_bytes": NUMBER}
_STRAGGLER = {"rank": _int, "phase": _text, "busy_s": NUMBER, "median_busy_s": NUMBER,
              "phase_excess_s": NUMBER, "spread_s": NUMBER}


def _fits(record: dict, fields: dict[str, Callable], required: tuple[str, ...] = ()) -> bool:
    return (all(name in record for name in required)
            and all(check(record[name]) for name, check in fields.items() if name in record))


def _rows(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(row, dict) and _fits(row, _ROW, ("rank",)) for row in value)


def _straggler(value) -> bool:
    return value is None or (isinstance(value, dict) and _fits(value, _STRAGGLER, ("rank",)))


# Per type: the fields that are read, and which of them must be there. Steps and
# validations are placed on the curves by their step; a window by its first and last.
SCHEMAS: dict[str, tuple[dict[str, Callable], tuple[str, ...]]] = {
    "step": ({"step": _int, "epoch": INT, "time": NUMBER, "loss": NUMBER, "lr": NUMBER,
              "grad_norm": NUMBER, "step_time_s": NUMBER, "samples_per_s": NUMBER,
              "tokens_per_s": NUMBER, "mfu": NUMBER, "comm_bytes": NUMBER,
              "episode_return": NUMBER, "phases_s": _maybe(_number_map),
              "rank_step_s": _maybe(_numbers), "rank_comm_s": _maybe(_numbers)}, ("step",)),
    "ranks": ({"steps": _steps, "time": NUMBER, "ranks": _rows, "straggler": _straggler},
              ("steps", "ranks")),
    "validation": ({"step": _int, "time": NUMBER, "val_loss": NUMBER,
                    "eval_return": NUMBER}, ("step",)),
    "event": ({"step": _int, "time": NUMBER, "kind": _text, "restart": INT,
               "world_size": INT, "memory_limit_bytes": NUMBER}, ()),
}
_OTHER = ({"step": _int}, ("step",))  # a type the dashboard does not show


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
    return record if _fits(record, *schema) else None
