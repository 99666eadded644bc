"""Run configs of a digits model whose middle block is local or on a remote tier, and the
final state a run leaves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from shoal.checkpoint import CheckpointStore


def write_config(directory: Path, endpoint: str | None, remote: dict[str, Any] | None = None,
                 **trainer: Any) -> Path:
    """A run config in ``directory`` (its run dir and checkpoints there too); the block is
    remote when ``endpoint`` is given, with ``remote`` added to remote_hardware."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "model": {"builder": "tests.remote.blocks:model", "args": {"remote": bool(endpoint)}},
        "data": {"builder": "shoal.examples.digits:build_data", "args": {"seed": 0}},
        "optimizer": {"builder": "torch.optim:AdamW", "args": {"lr": 0.003}},
        "trainer": {"batch_size": 16, "max_steps": 12, "seed": 0, "progress": False,
                    "checkpoint_dir": str(directory / "checkpoints"), **trainer},
        "run": {"dir": str(directory)},
    }
    if endpoint:
        config["remote_hardware"] = {"endpoint": endpoint, **(remote or {})}
    path = directory / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def final_state(directory: Path) -> tuple[dict, dict]:
    """(model and optimizer state, meta) of the run's newest checkpoint."""
    store = CheckpointStore(directory / "checkpoints")
    shared, _, meta = store.load(store.latest())
    return {"model": shared["model"], "optimizer": shared["optimizer"]}, meta
