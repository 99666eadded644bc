"""Errors that shoal reports as one line to the user instead of a traceback."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pydantic is imported by the configs that call usage_error
    from pydantic import ValidationError


class UsageError(ValueError):
    """Bad input from the user (command line, configuration). The CLI prints it and exits 2.

    Raised by shoal's command line and Python API when an argument, a setting or the data is
    wrong; the message names it and says what to change.
    """


class LaunchError(RuntimeError):
    """A job that shoal started on the user's behalf did not run as it must.

    Raised by `shoal bench scaling` when the run at one world size fails, or records no step
    after the warm-up steps.
    """


class NonFiniteError(RuntimeError):
    """A NaN or Inf loss or gradient with nonfinite='stop'; names the step and the ranks.

    Raised by ``Trainer.fit`` when ``nonfinite='stop'`` and a step's gradients are not finite.
    """


class Preempted(BaseException):
    """A preemption signal (SIGTERM, SIGUSR1) that came while a live job's rank waited for the
    other replica groups: the Trainer saves the last committed step and exits with 128 +
    ``signum``. Not an Exception: no retry loop may take it for a failed try.
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def usage_error(exc: ValidationError, prefix: str = "") -> UsageError:
    """Pydantic's validation errors as one line that names each bad key and why."""
    parts = []
    for err in exc.errors():
        key = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        if err["type"] == "extra_forbidden":
            parts.append(f"{key}: unknown key")
        elif err["type"] == "value_error":  # a rule across settings: its message says it all
            message = err["msg"].removeprefix("Value error, ")
            parts.append(f"{key}: {message}" if key else message)  # a rule of the whole run
        else:
            parts.append(f"{key}: {err['msg']} (got {err.get('input')!r})")
    return UsageError("invalid configuration: " + "; ".join(parts))
