"""Errors that shoal reports as one line to the user instead of a traceback."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pydantic is imported by the configs that call usage_error
    from pydantic import ValidationError


class UsageError(ValueError):
    """Bad input from the user (command line, configuration). The CLI prints it and exits 2."""


class LaunchError(RuntimeError):
    """The launch could not start (e.g. the requested port is taken)."""


class NonFiniteError(RuntimeError):
    """A NaN or Inf loss or gradient with nonfinite='stop'; names the step and the ranks."""


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
