"""Read a run config: YAML, then `key.sub=value` overrides, then schema and builder checks."""

from __future__ import annotations

import inspect
import os
import re
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import TypeAdapter, ValidationError

from shoal.config.schema import BuilderConfig, ModelConfig, RLRunConfig, RunConfig
from shoal.errors import UsageError, usage_error
from shoal.imports import default_code_paths, import_builder, use_code_paths

if TYPE_CHECKING:
    from collections.abc import Sequence


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads 1e-3 (no dot) as a string; learning rates are written that way."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def read_yaml(text: str) -> object:
    return yaml.load(text, Loader=_Loader)


# Builders called with a leading positional argument that the config does not give.
_LEADING_ARG = {"optimizer": "params", "lr_scheduler": "optimizer"}


def apply_override(tree: dict[str, Any], assignment: str) -> None:
    """Set ``a.b.c=value`` in a nested dict; the value is read as YAML (1e-3, true, [1, 2])."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise UsageError(f"override {assignment!r} must look like key.sub=value")
    try:
        value = read_yaml(raw) if raw else None
    except yaml.YAMLError:
        value = raw
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UsageError(f"override {key}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def _check_builder(section: str, spec: BuilderConfig | ModelConfig) -> None:
    assert spec.builder is not None  # not a transformers model: the caller checked
    fn = import_builder(spec.builder, f"{section}.builder")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: checked when called
    leading = [object()] if section in _LEADING_ARG else []
    try:
        signature.bind(*leading, **spec.args)
    except TypeError as exc:
        raise UsageError(f"{section}.args: {exc} (builder {spec.builder})") from None
    _check_argument_types(section, spec, fn)


def _check_argument_types(section: str, spec: BuilderConfig | ModelConfig, fn: Any) -> None:
    """Each argument against the builder's own annotation, as the rest of the config is
    checked: a wrong type fails here, in one line, rather than in every worker. A value
    pydantic converts losslessly (the string "3" for an int) is passed on converted."""
    try:
        hints = typing.get_type_hints(fn.__init__ if inspect.isclass(fn) else fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: checked when called
        return
    for name, value in spec.args.items():
        if name not in hints:
            continue
        try:
            adapter = TypeAdapter(hints[name])
        except Exception:  # noqa: BLE001 - a type pydantic cannot check (any class)
            continue
        try:
            spec.args[name] = adapter.validate_python(value)
        except ValidationError as exc:
            reason = exc.errors()[0]["msg"]
            raise UsageError(f"{section}.args.{name}: {reason} (got {value!r}; builder "
                             f"{spec.builder})") from None


def load_run_config(path: str | os.PathLike, overrides: Sequence[str] = ()
                    ) -> RunConfig | RLRunConfig:
    """Load, override and validate a run config; every problem is a one-line UsageError."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"config file not found: {path}")
    try:
        tree = read_yaml(path.read_text()) or {}
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read config {path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"{path} is not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(tree, dict):
        raise UsageError(f"{path} must hold a mapping of sections (model, data, ...)")
    return validate_run_tree(tree, path.stem, overrides, config_file=path)


def validate_run_tree(tree: dict[str, Any], name: str, overrides: Sequence[str] = (),
                      config_file: Path | None = None) -> RunConfig | RLRunConfig:
    """A run config from its sections: an ``rl:`` run when it has one, else a Trainer run.
    ``name`` names the default run directory, runs/<name>. Builders are imported from the
    directory of ``config_file`` and the current directory first (``run.code_paths``)."""
    for assignment in overrides:
        apply_override(tree, assignment)
    _resolve_code_paths(tree, config_file)
    try:
        config = RLRunConfig(**tree) if "rl" in tree else RunConfig(**tree)
    except ValidationError as exc:
        raise usage_error(exc) from None
    if config.run.dir is None:
        config.run.dir = str(Path("runs") / name)
    if isinstance(config, RLRunConfig):
        if config.rl.metrics.dir is None:
            config.rl.metrics.dir = config.run.dir
        return config
    for section in ("model", "data", "optimizer", "lr_scheduler", "loss"):
        spec = getattr(config, section)
        if spec is not None and spec.builder is not None:  # not a transformers model
            _check_builder(section, spec)
    for key in ("callbacks", "metrics.trackers"):  # named now, not in each worker
        specs = config.trainer.callbacks if key == "callbacks" else config.trainer.metrics.trackers
        for i, spec in enumerate(specs):
            import_builder(spec if isinstance(spec, str) else spec.builder,
                           f"trainer.{key}[{i}]")
    if config.remote_hardware is not None:
        import_builder(config.remote_hardware.tier_plugin, "remote_hardware.tier_plugin")
        config.remote_hardware.token()  # readable now, not first in every worker
    if config.trainer.metrics.dir is None:  # step metrics go to the run directory
        config.trainer.metrics.dir = config.run.dir
    return config


def _resolve_code_paths(tree: dict[str, Any], config_file: Path | None) -> None:
    """Fix the directories searched for the user's modules, as absolute paths in the tree,
    and search them first in this process, before any validator imports a name (an RL
    environment's module). A worker reading the resolved config gets them verbatim."""
    run = tree.setdefault("run", {})
    if not isinstance(run, dict):
        return  # refused by the schema
    given = run.get("code_paths")
    if given is None:
        run["code_paths"] = default_code_paths(config_file)
    elif isinstance(given, list) and all(isinstance(entry, str) for entry in given):
        base = Path(config_file).resolve().parent if config_file is not None else Path.cwd()
        run["code_paths"] = [str((base / entry).resolve()) for entry in given]
    else:
        return  # refused by the schema
    use_code_paths(run["code_paths"])


def save_run_config(config: RunConfig | RLRunConfig) -> Path:
    """Write the resolved config into the run directory; returns its path."""
    assert config.run.dir is not None  # validate_run_tree set it
    run_dir = Path(config.run.dir)
    target = run_dir / "config.yaml"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        target.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    except OSError as exc:
        raise UsageError(f"run.dir {run_dir}: cannot write the run directory "
                         f"({exc.strerror})") from None
    return target


def build(spec: BuilderConfig | ModelConfig, *leading: Any) -> Any:
    """Call the builder named in ``spec`` with its args (or build its transformers model)."""
    if isinstance(spec, ModelConfig) and spec.hf is not None:
        from shoal.models.hf import build_model

        return build_model(spec.hf)
    assert spec.builder is not None  # a ModelConfig has a builder or hf
    return import_builder(spec.builder, "builder")(*leading, **spec.args)
