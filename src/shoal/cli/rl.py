"""`shoal rl`: distributed PPO on a gymnasium environment, without a config file."""

from __future__ import annotations

import argparse

from shoal.cli.dashboard import add_dashboard_arguments
from shoal.cli.run import add_fetch_arguments, add_launch_arguments


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "rl",
        help="train a PPO policy on a gymnasium environment",
        description="Environment-parallel PPO: each of --nproc-per-node processes steps its "
        "own environments; the gradients are all-reduced. Settings: key=value (any field of "
        "the rl: section, e.g. num_envs=4 learning_rate=3e-4; run.dir=PATH), the same as "
        "`shoal train --config RUN.yaml` with an rl: section.",
    )
    parser.add_argument("--env", required=True, metavar="ID",
                        help="gymnasium environment id (CartPole-v1, Acrobot-v1, Pendulum-v1)")
    parser.add_argument("--total-steps", type=int, default=None, metavar="N",
                        help="environment steps of the whole job (default 100000)")
    add_launch_arguments(parser)
    add_fetch_arguments(parser)
    add_dashboard_arguments(parser)
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="rl settings; the value is read as YAML")
    parser.set_defaults(handler=rl_command, command="rl")
    return parser


def rl_command(args: argparse.Namespace) -> int:
    from shoal.cli.train import launch_run
    from shoal.config.loader import validate_run_tree

    tree: dict = {"rl": {"env": args.env}}
    if args.total_steps is not None:
        tree["rl"]["total_steps"] = args.total_steps
    # Bare keys are the rl section's; run.* and rl.* are accepted as written.
    overrides = [item if item.split("=", 1)[0].split(".")[0] in ("rl", "run") else f"rl.{item}"
                 for item in args.overrides]
    name = args.env.rpartition(":")[2]
    config = validate_run_tree(tree, name, overrides)
    return launch_run(args, config, None, [])
