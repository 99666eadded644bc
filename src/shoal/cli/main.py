"""Entry point of the `shoal` command: dispatch to subcommands, turn usage errors into one line."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import TYPE_CHECKING

from shoal.cli import bench as bench_cmd
from shoal.cli import dashboard as dashboard_cmd
from shoal.cli import data as data_cmd
from shoal.cli import doctor as doctor_cmd
from shoal.cli import env as env_cmd
from shoal.cli import export as export_cmd
from shoal.cli import k8s as k8s_cmd
from shoal.cli import remote as remote_cmd
from shoal.cli import rl as rl_cmd
from shoal.cli import run as run_cmd
from shoal.cli import slurm as slurm_cmd
from shoal.cli import train as train_cmd
from shoal.cli.parser import Parser
from shoal.errors import UsageError
from shoal.version import __version__

if TYPE_CHECKING:
    import argparse


def build_parser() -> tuple[Parser, dict[str, argparse.ArgumentParser]]:
    """The `shoal` parser, and its subparsers that take overrides among their flags."""
    parser = Parser(prog="shoal", description="Distributed PyTorch training that keeps running.",
                    epilog="Run 'shoal COMMAND --help' for what a command does and its options.")
    parser.add_argument("--version", action="version", version=f"shoal {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    subparsers.required = True
    run_cmd.register(subparsers)
    train = train_cmd.register(subparsers)
    env_cmd.register(subparsers)
    export_cmd.register(subparsers)
    doctor_cmd.register(subparsers)
    bench_cmd.register(subparsers)
    data_cmd.register(subparsers)
    dashboard_cmd.register(subparsers)
    remote_cmd.register(subparsers)
    intermixed = {"train": train, "rl": rl_cmd.register(subparsers),
                  "slurm": slurm_cmd.register(subparsers),
                  "k8s": k8s_cmd.register(subparsers)}
    parser.commands = subparsers.choices
    return parser, intermixed


def _end_now(code: int) -> None:
    """End the program with ``code`` without the interpreter's teardown, once atexit
    handlers have run and output is out: a launcher has torch imported, whose teardown takes
    about 0.4 s after the job has ended (torchrun pays it). Not while a thread that is no
    daemon still runs, which the teardown would wait for."""
    main_thread = threading.main_thread()
    if any(t is not main_thread and not t.daemon for t in threading.enumerate()):
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def torchrun_status(code: int) -> int:
    """What torchrun exits with where shoal exits with ``code``: 0, or 1 for any failure
    (a rank's, a signal to the launcher, a hang). A command line refused before anything
    starts is 2 under both, as argparse's errors are."""
    return 0 if code == 0 else 1


def main(argv: list[str] | None = None) -> int:
    program = argv is None  # the `shoal` command itself, not a call from Python
    argv = sys.argv[1:] if argv is None else argv
    parser, intermixed = build_parser()
    if argv[:1] and argv[0] in intermixed:
        # Overrides and flags in any order: 'a=1 --nproc-per-node 2 b=2'.
        args = intermixed[argv[0]].parse_intermixed_args(argv[1:])
    else:
        args, extra = parser.parse_known_args(argv)
        if extra:  # told by the subcommand's parser, which knows its flags
            parser.commands.get(args.command, parser).error(
                f"unrecognized arguments: {' '.join(extra)}")
    if program and args.command in ("run", "train", "rl"):
        from shoal.cli.run import fork_server_ahead
        from shoal.launch.scheduling import apply_scheduling

        apply_scheduling(args.scheduling)  # first: everything started from here inherits it
        fork_server_ahead(args)
    try:
        code = args.handler(args)
    except UsageError as exc:
        sys.stderr.write(f"shoal {args.command}: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("shoal: interrupted\n")
        code = 130
    if getattr(args, "torchrun_exit_codes", False):
        code = torchrun_status(code)
    if program and args.command == "run":
        _end_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
