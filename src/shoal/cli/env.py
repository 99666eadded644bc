"""`shoal env`: everything a bug report needs about this machine and job."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("env", help="versions, devices and network for bug reports")
    parser.set_defaults(handler=env_command)


def env_command(args: argparse.Namespace) -> int:
    from shoal.runtime.info import print_env_report

    print_env_report()
    return 0
