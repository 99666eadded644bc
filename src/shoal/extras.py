"""shoal's optional parts: the extra that installs each, and one way to ask for one.

``pip install shoal`` brings what `shoal run`, ``shoal.spawn``, the runtime API and the
Trainer need (every parallel strategy, checkpoints, step metrics to JSON lines). The rest
is installed by name, ``pip install 'shoal[NAME]'``; ``shoal[all]`` brings every one.
A feature whose extra is missing says so in one line (a ``UsageError``), and `shoal train`
says it before any process starts when the run config asks for the feature.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from shoal.errors import UsageError

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Extra:
    modules: tuple[str, ...]  # what must be importable
    brings: str  # what the extra is for, as the docs say it
    packages: tuple[str, ...] = ()  # their names on PyPI, where they differ

    def package(self, module: str) -> str:
        return self.packages[self.modules.index(module)] if self.packages else module


EXTRAS: dict[str, Extra] = {
    "tensorboard": Extra(("tensorboard",), "TensorBoard event files of the step metrics"),
    "dashboard": Extra(("starlette", "uvicorn"), "the live dashboard (shoal dashboard, "
                                                 "--dashboard)"),
    "remote": Extra(("grpc", "grpc_health"), "the remote hardware tier (shoal remote, "
                                             "remote_hardware)",
                    ("grpcio", "grpcio-health-checking")),
    "rl": Extra(("gymnasium",), "reinforcement learning (shoal rl)"),
    "examples": Extra(("sklearn",), "the digits example's data (scikit-learn's digits)",
                      ("scikit-learn",)),
    "plot": Extra(("matplotlib",), "the chart of shoal bench scaling (scaling.png)"),
    "hf": Extra(("transformers", "datasets"), "Hugging Face models and datasets"),
    "mlflow": Extra(("mlflow",), "logging runs to MLflow (trainer.metrics.mlflow)"),
    "wandb": Extra(("wandb",), "logging runs to Weights & Biases (trainer.metrics.wandb)"),
    "ft": Extra(("torchft",), "live recovery (--replica-groups, fault_tolerance.mode: "
                              "live)"),
}


def install_line(extra: str) -> str:
    return f"pip install 'shoal[{extra}]'"


def extra_of(module: str) -> str | None:
    """The extra that installs the top-level package of ``module``, if any."""
    top = module.partition(".")[0]
    return next((name for name, extra in EXTRAS.items() if top in extra.modules), None)


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here."""
    return [name for name in EXTRAS[extra].modules if importlib.util.find_spec(name) is None]


def installed(extra: str) -> bool:
    """Whether every module of ``extra`` can be imported here.

    Raises:
        KeyError: If ``extra`` is not one of shoal's extras.
    """
    return not missing(extra)


def require(extra: str, feature: str | None = None) -> None:
    """Nothing if ``extra`` is installed; else a one-line UsageError naming what to install.
    ``feature``: what needs it, in the user's words (default: what the extra brings).

    Raises:
        UsageError: If a module of ``extra`` cannot be imported; the message names the
            packages and the pip line that installs them.
        KeyError: If ``extra`` is not one of shoal's extras.
    """
    absent = [EXTRAS[extra].package(module) for module in missing(extra)]
    if absent:
        what = feature or EXTRAS[extra].brings
        raise UsageError(f"{what} needs {' and '.join(absent)}, not installed here: "
                         f"{install_line(extra)}")


def needs(extra: str) -> Callable[[F], F]:
    """Mark a builder a run config may name as needing ``extra``: the config's loader
    checks it (``shoal.imports.import_builder``), before any process starts.

    Never raises.
    """
    def mark(function: F) -> F:
        function.shoal_extra = extra  # type: ignore[attr-defined]
        return function
    return mark
