"""Errors that shoal reports as one line to the user instead of a traceback."""


class UsageError(ValueError):
    """Bad input from the user (command line, configuration). The CLI prints it and exits 2."""


class LaunchError(RuntimeError):
    """The launch could not start (e.g. the requested port is taken)."""


class NonFiniteError(RuntimeError):
    """A NaN or Inf loss or gradient with nonfinite='stop'; names the step and the ranks."""
