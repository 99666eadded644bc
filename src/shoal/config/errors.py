"""Turn pydantic's validation errors into one line that names each bad key and why."""

from __future__ import annotations

from pydantic import ValidationError

from shoal.errors import UsageError


def usage_error(exc: ValidationError, prefix: str = "") -> UsageError:
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
