"""`shoal train`: train from a YAML run config, on one or many processes."""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path
from typing import Any

from shoal.cli.dashboard import add_dashboard_arguments, serve_during
from shoal.cli.run import (
    add_fetch_arguments,
    add_launch_arguments,
    announce,
    detect_cluster,
    fetch_first,
    spec_from_args,
    start,
)
from shoal.errors import UsageError
from shoal.extras import require


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train",
        help="train from a YAML run config",
        description="Validate RUN.yaml, save the resolved config in the run directory, and "
        "train on --nproc-per-node processes. Overrides: key.sub=value (e.g. trainer.epochs=5).",
    )
    parser.add_argument("--config", required=True, metavar="RUN.yaml", help="the run config")
    add_launch_arguments(parser)
    add_fetch_arguments(parser)
    add_dashboard_arguments(parser)
    parser.add_argument("--profile-steps", metavar="FIRST-LAST", default=None,
                        help="profile these steps on every rank with torch.profiler: a "
                        "Chrome trace per rank in the run directory's profile/ (the same as "
                        "trainer.profile_steps=FIRST-LAST)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="override config values; the value is read as YAML")
    parser.set_defaults(handler=train_command, command="train")
    return parser


def train_command(args: argparse.Namespace) -> int:
    from shoal.config.loader import load_run_config

    if args.profile_steps is not None:
        args.overrides = [*args.overrides, f"trainer.profile_steps={args.profile_steps}"]
    config = load_run_config(args.config, args.overrides)
    return launch_run(args, config, args.config, args.overrides)


def launch_run(args: argparse.Namespace, config: Any, source: str | None,
               overrides: list[str]) -> int:
    """Check what depends on the job's size, then train ``config`` (a Trainer run or an
    ``rl:`` run) on this node's processes. ``source``: the user's config file, which the
    other nodes' workers read with ``overrides`` (None: they read a copy of ``config``)."""
    from shoal.config.loader import save_run_config
    from shoal.config.schema import RLRunConfig
    from shoal.runtime.dist import check_gpus

    rl = isinstance(config, RLRunConfig)
    entry = "shoal.launch.rl_entry" if rl else "shoal.launch.train_entry"
    if args.nproc_per_node is not None:
        config.run.nproc_per_node = args.nproc_per_node  # validated again by spec_from_args
    if getattr(args, "dashboard", False):
        require("dashboard", "--dashboard")  # before anything starts or is written
        if args.log_dir is None:
            # Logs and heartbeats in the run directory: the dashboard names a rank that stops.
            args.log_dir = str(Path(config.run.dir) / "logs")
    cluster = detect_cluster(args)
    spec = spec_from_args(args, entry, [], module=True,
                          nproc_default=config.run.nproc_per_node, cluster=cluster,
                          fault_tolerance=None if rl else config.trainer.fault_tolerance)
    if rl and spec.live:
        raise UsageError("live mode (--replica-groups) trains Trainer runs; an rl: run "
                         "recovers by restart (--max-restarts)")
    # Where the scheduler started every worker (srun -n 8, mpirun), this process is one rank.
    in_place = cluster is not None and cluster.per_process
    world = cluster.world_size if in_place and cluster is not None else spec.world_size
    # What does not fit the job fails here, in one line, before any worker starts.
    if rl:
        config.rl.updates(world)
    else:
        config.trainer.parallel.resolve(world)
    if in_place:
        assert cluster is not None  # in_place says so
        config.run.nproc_per_node = cluster.local_world_size or 1
        first = cluster.rank == 0
    else:
        config.run.nproc_per_node = spec.nproc_per_node
        first = spec.node_rank == 0
    check_gpus(config.rl.backend if rl else config.trainer.backend, config.run.nproc_per_node)
    overrides = [*overrides, *_resume_on_restart(config, spec, rl, first)]
    metrics = config.rl.metrics if rl else config.trainer.metrics
    if metrics.mlflow is not None and first:  # rank 0's node logs to it: reachable now
        from shoal.metrics.mlflow import check_tracking

        section = f"{'rl' if rl else 'trainer'}.metrics.mlflow"
        print(f"shoal: {check_tracking(metrics.mlflow, section)}", file=sys.stderr, flush=True)
    if not rl and config.remote_hardware is not None:
        from shoal.remote.tier import probe

        print(f"shoal: {probe(config.remote_hardware)}", file=sys.stderr, flush=True)
    fetched = fetch_first(args, cluster)  # the data is in place before anything is built
    if fetched:
        return fetched
    resolved = save_run_config(config) if first else None
    metrics_dir = metrics.dir or config.run.dir
    with serve_during(args, metrics_dir if first else None):
        if spec.world_size == 1 and not in_place and not spec.live:
            announce(spec, cluster)
            importlib.import_module(entry).train_from_config(config)
            return 0
        private = _private_copy(config) if resolved is None and source is None else None
        # The others read the config and overrides themselves, without waiting for the file.
        config_file = resolved or private or source
        spec.args = ["--config", str(config_file), *([] if resolved or private else overrides)]
        try:
            return start(spec, cluster)
        finally:
            if private is not None:
                private.unlink(missing_ok=True)


def _resume_on_restart(config: Any, spec: Any, rl: bool, first: bool) -> list[str]:
    """A job that restarts its workers (``--max-restarts``, ``--nnodes MIN:MAX``) continues
    from its newest checkpoint unless the config says otherwise: ``resume: auto`` is implied,
    and said. Without a checkpoint directory a restart starts over, and that is said too.
    Returns the override that gives the other nodes' workers the same setting."""
    if not (spec.max_restarts > 0 or spec.min_nodes is not None):
        return []
    section, name = (config.rl, "rl") if rl else (config.trainer, "trainer")
    why = (f"--max-restarts {spec.max_restarts}" if spec.max_restarts > 0
           else f"--nnodes {spec.min_nodes}:{spec.nnodes}")
    if section.resume is not None:
        return []
    if section.checkpoint_dir is None:
        if first and not getattr(spec, "live", False):  # live: a restarted group heals instead
            print(f"shoal: warning: {why} without {name}.checkpoint_dir: a restarted worker "
                  f"starts the run over from step 0 (set {name}.checkpoint_dir and "
                  f"{name}.checkpoint_every to continue instead)", file=sys.stderr, flush=True)
        return []
    section.resume = "auto"
    if first:
        print(f"shoal: {why}: a restarted worker continues from the newest checkpoint in "
              f"{section.checkpoint_dir} ({name}.resume=auto implied; set {name}.resume to "
              f"choose otherwise)", file=sys.stderr, flush=True)
    return [f"{name}.resume=auto"]


def _private_copy(config: Any) -> Path:
    """The resolved config in a file of this node's own (not the shared run directory)."""
    handle = tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="shoal-run-",
                                         delete=False)
    with handle:
        import yaml  # not at the top: `shoal run` shares this module's import (70 ms)

        yaml.safe_dump(config.model_dump(mode="json"), handle, sort_keys=False)
    return Path(handle.name)
