"""An argparse parser whose errors are one line and exit code 2."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from typing import NoReturn


class _HelpFormatter(argparse.HelpFormatter):
    """Leaves torchrun's underscore spellings (``--nproc_per_node``) out of ``--help``."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        shown = [s for s in action.option_strings if not (s.startswith("--") and "_" in s)]
        if not action.option_strings or shown == action.option_strings:
            return super()._format_action_invocation(action)
        original = action.option_strings
        action.option_strings = shown
        try:
            return super()._format_action_invocation(action)
        finally:
            action.option_strings = original


class Parser(argparse.ArgumentParser):
    """Prints 'shoal run: error: ...' with a hint instead of the usage block; an unknown
    flag gets the nearest flags that exist ("did you mean").

    Abbreviations are off: '--nproc 2' is an error, not a silent '--nproc-per-node 2'.
    """

    commands: dict[str, Parser]
    """The `shoal` parser's subcommands, by name (set by shoal.cli.main)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def _nearest(self, unknown: str) -> str | None:
        """The flag ``unknown`` was most likely meant as: the one that shares the longest
        start with it (at least 4 letters past the dashes), else the closest spelling."""
        flags = [s for action in self._actions for s in action.option_strings
                 if s.startswith("--") and "_" not in s]
        name = unknown.split("=", 1)[0].replace("_", "-")
        shared = max(flags, key=lambda f: len(os.path.commonprefix([f, name])), default=None)
        if shared is not None and len(os.path.commonprefix([shared, name])) >= 7:
            return shared
        close = difflib.get_close_matches(name, flags, n=1, cutoff=0.6)
        return close[0] if close else None

    def error(self, message: str) -> NoReturn:
        hint = ""
        found = re.match(r"unrecognized arguments: (.*)", message)
        if found:
            unknown = [word for word in found.group(1).split() if word.startswith("-")]
            guesses = [f"{self._nearest(word)} for {word.split('=', 1)[0]}"
                       for word in unknown if self._nearest(word)]
            if guesses:
                hint = f"; did you mean {', '.join(guesses)}?"
        sys.stderr.write(f"{self.prog}: error: {message}{hint} (see '{self.prog} --help')\n")
        raise SystemExit(2)
