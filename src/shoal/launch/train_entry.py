"""Worker entry of `shoal train`: build everything from a resolved config and fit.

Run by the launcher as ``python -m shoal.launch.train_entry --config RUN_DIR/config.yaml``
(node 0), or ``--config RUN.yaml key.sub=value ...`` (the other nodes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal.config.loader import build, load_run_config
from shoal.config.schema import RunConfig


def train_from_config(config: RunConfig) -> dict[str, float]:
    """Build model, data, optimizer (and scheduler, loss) from ``config`` and train."""
    from shoal.runtime import dist as rt

    rt.init(config.trainer.backend)
    with _remote_tier(config):
        return _train(config)


def _remote_tier(config: RunConfig) -> contextlib.AbstractContextManager:
    """The run's remote tier, for the model's RemoteModule, while the run trains."""
    if config.remote_hardware is None:
        return contextlib.nullcontext()
    from shoal.remote import load_tier, using

    return using(load_tier(config.remote_hardware))


def _train(config: RunConfig) -> dict[str, float]:
    from shoal.training.trainer import Trainer

    model = build(config.model)
    data = build(config.data)
    train_data, val_data = data if isinstance(data, tuple) else (data, None)
    optimizer = build(config.optimizer, model.parameters())
    # Built by the Trainer on the optimizer it trains with (zero1 replaces the optimizer).
    schedule = config.lr_scheduler
    scheduler = (lambda opt: build(schedule, opt)) if schedule else None
    loss_fn = build(config.loss) if config.loss else None
    # fault_tolerance: the launcher runs this config's (its flags over it) and hands it to
    # every worker, where the Trainer reads it; given here too, each of its defaults would
    # read as a setting of the Trainer's own that the launcher overrules.
    trainer = Trainer(model, optimizer, loss_fn=loss_fn, lr_scheduler=scheduler,
                      **config.trainer.model_dump(exclude={"fault_tolerance"}))
    trainer.run_config = config.model_dump(mode="json")
    metrics = trainer.fit(train_data, val_data)
    # Rank 0 of every live group writes the final metrics (the groups end as one model, the
    # same figures but timings): the group that reports may be lost after its end.
    if trainer.writes_metrics:
        assert config.run.dir is not None  # the loader sets it
        path = Path(config.run.dir) / "metrics.json"
        # whole or not at all: a kill mid-write, or another group's write beside it
        written = path.with_name(f".metrics.json.{os.getpid()}")
        path.parent.mkdir(parents=True, exist_ok=True)
        written.write_text(json.dumps(metrics, indent=2))
        os.replace(written, path)
    if trainer.reports:
        shown = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in metrics.items())
        print(f"done: {shown}\nrun directory: {config.run.dir}", flush=True)
    return metrics


def worker_main(prog: str, train: Callable[[Any], object]) -> None:
    """A worker's command line: read the config (and overrides), ``train`` it, leave the
    process group."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--config", required=True)
    # Nodes other than 0 read the user's config and overrides, not node 0's resolved copy.
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = parser.parse_args()
    from shoal.runtime import dist as rt

    train(load_run_config(args.config, args.overrides))
    # The training objects (and their DDP wrappers) are gone by now; the group can go safely.
    rt.cleanup()


def main() -> None:
    worker_main("shoal.launch.train_entry", train_from_config)


if __name__ == "__main__":
    main()
