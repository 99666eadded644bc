"""An argparse parser whose errors are one line and exit code 2."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """Prints 'shoal run: error: ...' with a hint instead of the usage block.

    Abbreviations are off: '--nproc 2' is an error, not a silent '--nproc-per-node 2'.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
        raise SystemExit(2)
