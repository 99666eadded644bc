"""`shoal slurm`: print an sbatch script that trains a run config on N nodes."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "slurm",
        help="print an sbatch script for a run config",
        description="Print a batch script that runs `shoal train` on --nodes nodes (one task "
        "per node; shoal reads the rest from SLURM), and requeues the job when the time "
        "limit is near: the workers save a checkpoint first, and the next run resumes from "
        "it (trainer.resume=auto; trainer.checkpoint_dir defaults to RUN_DIR/checkpoints).",
    )
    parser.add_argument("--config", required=True, metavar="RUN.yaml", help="the run config")
    parser.add_argument("--nodes", type=int, required=True, help="number of nodes")
    parser.add_argument("--gpus-per-node", type=int, default=0, metavar="G",
                        help="GPUs per node, one worker each (default 0: one CPU worker)")
    parser.add_argument("--nproc-per-node", type=int, default=None, metavar="P",
                        help="workers per node (default: the GPUs per node, else 1)")
    parser.add_argument("--cpus-per-task", type=int, default=None, metavar="C",
                        help="CPUs for each node's workers (default: the cluster's)")
    parser.add_argument("--time", default=None, metavar="HH:MM:SS",
                        help="time limit, HH:MM:SS or D-HH:MM:SS (default: the partition's)")
    parser.add_argument("--partition", default=None, help="partition (queue)")
    parser.add_argument("--job-name", default=None,
                        help="job name (default shoal-<config name>)")
    parser.add_argument("--account", default=None, help="account to charge")
    parser.add_argument("--signal-seconds", type=int, default=120, metavar="S",
                        help="warn the job S seconds before the time limit (default 120)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="config overrides passed on to `shoal train`")
    parser.set_defaults(handler=slurm_command, command="slurm")
    return parser


def slurm_command(args: argparse.Namespace) -> int:
    from shoal.clusters.jobscripts import SlurmJob, requeue_overrides, sbatch_script
    from shoal.config.loader import load_run_config

    job = SlurmJob(
        config=args.config, nodes=args.nodes, overrides=list(args.overrides),
        gpus_per_node=args.gpus_per_node, workers=args.nproc_per_node,
        cpus_per_task=args.cpus_per_task, time=args.time,
        partition=args.partition, job_name=args.job_name or f"shoal-{Path(args.config).stem}",
        account=args.account, signal_seconds=args.signal_seconds, workdir=os.getcwd(),
    )
    job.overrides += requeue_overrides(load_run_config(args.config, job.overrides))
    load_run_config(args.config, job.overrides)  # what the job will run must load, too
    sys.stdout.write(sbatch_script(job))
    return 0
