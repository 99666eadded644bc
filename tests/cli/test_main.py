"""The `shoal` command itself: its version, and a help that lists every command."""

from __future__ import annotations

import shoal
from shoal.cli.main import build_parser
from tests.helpers import run_shoal, run_shoal_in_process


def test_version_is_the_packages():
    out = run_shoal("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"shoal {shoal.__version__}\n"


def test_help_gives_each_commands_purpose_and_where_to_read_more():
    out = run_shoal_in_process("--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps long lines
    commands = build_parser()[0]._subparsers._group_actions[0]._choices_actions
    assert len(commands) >= 11
    for command in commands:
        assert command.help, f"shoal {command.dest} has no one-line purpose"
        assert f"{command.dest} {command.help}" in text
    assert "Run 'shoal COMMAND --help'" in text
