"""`shoal train`: train from a YAML run config, on one or many processes."""

from __future__ import annotations

import argparse

from shoal.cli.run import (
    add_fetch_arguments,
    add_launch_arguments,
    announce,
    detect_cluster,
    fetch_first,
    spec_from_args,
    start,
)


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
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="override config values; the value is read as YAML")
    parser.set_defaults(handler=train_command, command="train")
    return parser


def train_command(args: argparse.Namespace) -> int:
    from shoal.config.loader import load_run_config, save_run_config
    from shoal.runtime.dist import check_gpus

    config = load_run_config(args.config, args.overrides)
    if args.nproc_per_node is not None:
        config.run.nproc_per_node = args.nproc_per_node  # validated again by spec_from_args
    cluster = detect_cluster(args)
    spec = spec_from_args(args, "shoal.training.entry", [], module=True,
                          nproc_default=config.run.nproc_per_node, cluster=cluster)
    # Where the scheduler started every worker (srun -n 8, mpirun), this process is one rank.
    in_place = cluster is not None and cluster.per_process
    # A topology that does not fit the job fails here, in one line, before any worker starts.
    config.trainer.parallel.resolve(cluster.world_size if in_place else spec.world_size)
    if in_place:
        config.run.nproc_per_node = cluster.local_world_size or 1
        first = cluster.rank == 0
    else:
        config.run.nproc_per_node = spec.nproc_per_node
        first = spec.node_rank == 0
    check_gpus(config.trainer.backend, config.run.nproc_per_node)
    fetched = fetch_first(args, cluster)  # the data is in place before anything is built
    if fetched:
        return fetched
    resolved = save_run_config(config) if first else None
    if spec.world_size == 1 and not in_place:
        from shoal.training.entry import train_from_config

        announce(spec, cluster)
        train_from_config(config)
        return 0
    # The others read the config and overrides themselves, without waiting for the file.
    spec.args = ["--config", str(resolved or args.config), *(
        [] if resolved else args.overrides)]
    return start(spec, cluster)
