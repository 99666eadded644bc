"""metrics.jsonl lines as a hostile or broken writer could leave them: a record of any kind
with random values of every type in the fields the dashboard reads, cut, garbled, random
bytes, deep nesting. Seeded by the caller's random.Random."""

from __future__ import annotations

import json
import random
import string
from typing import Any

from shoal.dashboard.records import SCHEMAS
from tests.dashboard.synthetic import event_line, step_line, window_line


def text(rng: random.Random, most: int = 12, alphabet: str = string.printable) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, most)))


def value(rng: random.Random, depth: int = 0) -> Any:
    """Any JSON value, and what json.dumps writes that is not JSON (NaN, Infinity)."""
    pick = rng.randrange(11 if depth < 2 else 9)
    return [lambda: None, lambda: rng.random() < 0.5, lambda: rng.randint(-2 ** 70, 2 ** 70),
            lambda: rng.uniform(-1e9, 1e9), lambda: text(rng), lambda: float("nan"),
            lambda: rng.choice([float("inf"), -1, 0, 2 ** 63, "\ud800", ""]),
            lambda: rng.choice([[0.1, 0.2], [1, 2], {"data": 0.1}]),
            lambda: rng.randint(0, 100),
            lambda: [value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
            lambda: {text(rng, 5): value(rng, depth + 1) for _ in range(rng.randint(0, 3))},
            ][pick]()


def record_of(rng: random.Random, step: int) -> dict:
    """A record as shoal writes one, of any kind, with random values in its fields."""
    kind = rng.choice(["step"] * 4 + ["ranks", "event", "validation", "other"])
    record = {"step": json.loads(step_line(step, world=rng.randint(1, 4))),
              "ranks": json.loads(window_line(max(step - 9, 0), step, slow_rank=rng.choice(
                  [None, 0, 1]), world=2)),
              "event": json.loads(event_line(rng.choice(["start", "resume", "end"]), step)),
              "validation": {"type": "validation", "step": step, "val_loss": 0.5},
              "other": {"type": text(rng, 6), "step": step}}[kind]
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
        kind = record.get("type")
        schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
        fields = [*(schema.names if schema else ["step"]), text(rng, 4)]
        target = record
        rows = record.get("ranks")
        if isinstance(rows, list) and rows and isinstance(rows[0], dict) and \
                rng.random() < 0.5:  # inside a rank's row
            target = rows[0]
            fields = list(target) + [text(rng, 4)]
        name = rng.choice(fields)
        if rng.random() < 0.15:
            target.pop(name, None)
        else:
            target[name] = value(rng)
    return record


def random_line(rng: random.Random, step: int) -> bytes:
    """One line (without its newline): mostly a record with random fields, now and then
    one cut short, a byte garbled, random bytes or brackets nested 50,000 deep."""
    line = json.dumps(record_of(rng, step), ensure_ascii=rng.random() < 0.8).encode(
        "utf-8", "surrogatepass")
    r = rng.random()
    if r < 0.05:  # cut short (the writer died mid-line)
        line = line[:rng.randrange(len(line))]
    elif r < 0.1:  # a byte garbled
        k = rng.randrange(len(line))
        line = line[:k] + bytes([rng.randrange(256)]) + line[k + 1:]
    elif r < 0.12:
        line = bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
    elif r < 0.13:
        line = b"[" * rng.randint(1, 50_000)
    return line.replace(b"\n", b" ")
