"""`shoal bench`: measure the network (all-reduce) and the job's scaling (W = 1 .. N)."""

from __future__ import annotations

import argparse
from pathlib import Path

from shoal.cli.run import add_launch_arguments, detect_cluster, spec_from_args, start
from shoal.errors import UsageError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="all-reduce bandwidth; scaling of a job")
    benches = parser.add_subparsers(dest="bench", metavar="BENCH", parser_class=type(parser))
    benches.required = True

    allreduce = benches.add_parser(
        "allreduce", help="all-reduce time and bandwidth from KB to hundreds of MB",
        description="Time all-reduces of growing sizes on the job's backend; print time, "
        "algorithm bandwidth and bus bandwidth (algorithm x 2(n-1)/n, as nccl-tests).")
    add_launch_arguments(allreduce)
    allreduce.add_argument("--min-size", default="1K", help="smallest message (default 1K)")
    allreduce.add_argument("--max-size", default="256M",
                           help="largest message (default 256M)")
    allreduce.add_argument("--factor", type=int, default=4,
                           help="ratio between sizes (default 4)")
    allreduce.add_argument("--iters", type=int, default=20, help="timed repetitions")
    allreduce.add_argument("--json", default=None, help="also write the rows to this file")
    allreduce.set_defaults(handler=allreduce_command, command="bench allreduce")

    scaling = benches.add_parser(
        "scaling", help="run a config at W = 1 .. N processes: speedup and efficiency",
        description="Train the run config for --steps steps at each W from 1 to "
        "--max-nproc; print throughput, speedup, efficiency against linear scaling and the "
        "share of the step spent waiting on communication; write scaling.json and "
        "scaling.png to --out.")
    scaling.add_argument("--config", required=True, metavar="RUN.yaml")
    scaling.add_argument("--max-nproc", type=int, default=2, help="largest W (default 2)")
    scaling.add_argument("--steps", type=int, default=60, help="steps per W (default 60)")
    scaling.add_argument("--warmup", type=int, default=10,
                         help="first steps left out of the figures (default 10)")
    scaling.add_argument("--out", default=None,
                         help="output directory (default runs/scaling-<config name>)")
    scaling.add_argument("overrides", nargs="*", metavar="key.sub=value")
    scaling.set_defaults(handler=scaling_command, command="bench scaling")


def allreduce_command(args: argparse.Namespace) -> int:
    from shoal.bench.allreduce import parse_size

    try:
        sizes = [parse_size(args.min_size), parse_size(args.max_size)]
    except argparse.ArgumentTypeError as exc:
        raise UsageError(str(exc)) from None
    if sizes[0] > sizes[1] or args.factor < 2 or args.iters < 1:
        raise UsageError("need --min-size <= --max-size, --factor >= 2 and --iters >= 1")
    bench_args = ["--min-size", args.min_size, "--max-size", args.max_size,
                  "--factor", str(args.factor), "--iters", str(args.iters)]
    if args.json:
        bench_args += ["--json", str(Path(args.json).resolve())]
    cluster = detect_cluster(args)
    return start(spec_from_args(args, "shoal.bench.allreduce", bench_args, module=True,
                                cluster=cluster), cluster)


def scaling_command(args: argparse.Namespace) -> int:
    from shoal.bench.scaling import run_scaling, table
    from shoal.config.loader import load_run_config
    from shoal.config.schema import RunConfig

    if args.max_nproc < 1 or args.steps <= args.warmup or args.warmup < 0:
        raise UsageError("need --max-nproc >= 1 and --steps > --warmup >= 0")
    config = load_run_config(args.config, args.overrides)
    if not isinstance(config, RunConfig):
        raise UsageError(f"shoal bench scaling measures a Trainer's steps: {args.config} is a "
                         "reinforcement learning run (its rl: section)")
    out = Path(args.out or Path("runs") / f"scaling-{Path(args.config).stem}")
    out.mkdir(parents=True, exist_ok=True)
    rows = run_scaling(config, args.max_nproc, args.steps, args.warmup, out)
    print(f"scaling of {args.config}: {args.steps} steps per W, the first {args.warmup} "
          "left out; batch per process as configured (weak scaling)")
    print(table(rows))
    print(f"written: {out / 'scaling.json'}, {out / 'scaling.png'}")
    return 0
