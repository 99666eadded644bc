"""What a checkpoint directory holds and whether one is complete: files only, no torch.

A run's configuration checks a ``resume`` path with ``problem`` before any process starts,
so the launcher of `shoal train` reads this module, not DCP (about 0.8 s of imports).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

STEP_DIR = re.compile(r"^step_(\d+)$")
OWN_DIR = re.compile(r"^step_(\d+)\.group(\d+)$")  # a live group's own part of a step
COMMIT = "COMMIT.json"
META = "shoal.json"


def problem(path: Path) -> str | None:
    """What makes the checkpoint at ``path`` unusable, or None when it is complete."""
    if not path.is_dir():
        return "no such directory"
    marker = path / COMMIT
    if not marker.is_file():
        if any(STEP_DIR.match(p.name) for p in path.iterdir()):
            return ("it is a directory of checkpoints, not one: name one of its step_N "
                    "folders, or set checkpoint_dir to it with resume: auto")
        return f"no commit marker ({COMMIT}): the save did not finish"
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError) as exc:
        return f"unreadable commit marker: {exc}"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"file {name} is missing"
        actual = file.stat().st_size
        if actual != size:
            return f"file {name} has {actual} bytes, {size} were written (truncated?)"
    return None
