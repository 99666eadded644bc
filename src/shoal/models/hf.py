"""The transformers adapter: a model class and its config arguments, checked and built.

A run config names a transformers model class and the arguments of its config; both are
checked when the config is read, before any process starts (an unknown class or argument
is one line), and the model is built from them with random weights whose values depend on
``seed`` only. Nothing is downloaded. The rest of shoal trains the result as any other
``nn.Module``: the model returns its own loss for batches that hold ``labels``, and its
layer classes (``_no_split_modules``) are the blocks of FSDP and activation checkpointing.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from types import ModuleType
from typing import Any, cast

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from shoal.errors import UsageError
from shoal.extras import install_line

EXTRA = install_line("hf")


def require_transformers() -> ModuleType:
    """The transformers package, or a one-line UsageError naming the extra to install."""
    try:
        import transformers
    except ImportError:
        raise UsageError(f"a transformers model needs the transformers package: {EXTRA}"
                         ) from None
    return transformers


def _did_you_mean(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def model_class(name: str) -> type[nn.Module]:
    """The transformers model class called ``name`` (GPT2LMHeadModel, LlamaForCausalLM...)."""
    transformers = require_transformers()
    found = getattr(transformers, name, None) if name.isidentifier() else None
    if not (inspect.isclass(found) and issubclass(found, transformers.PreTrainedModel)):
        models = [n for n in dir(transformers) if n[:1].isupper() and "For" in n or
                  n.endswith(("Model", "LMHeadModel"))]
        raise UsageError(f"transformers has no model class {name!r}"
                         f"{_did_you_mean(name, models)}")
    return cast("type[nn.Module]", found)  # a PreTrainedModel


def config_arguments(config_class: type) -> set[str]:
    """The arguments ``config_class`` knows: its fields, its aliases (GPT-2's
    ``hidden_size`` for ``n_embd``), and those of its base class."""
    if dataclasses.is_dataclass(config_class):
        names = {f.name for f in dataclasses.fields(config_class)}
    else:  # configs that are not dataclasses: their constructors' parameters
        names = {p.name for cls in config_class.__mro__ if "__init__" in vars(cls)
                 # mypy takes cls.__init__ for an instance's; cls is a class (ignore below)
                 for p in inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
                 if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
    return names | set(getattr(config_class, "attribute_map", {}))


def build_config(model: type[Any], arguments: dict[str, Any]) -> Any:
    """``model``'s config from ``arguments``, each checked: a transformers config would
    keep an unknown argument as a silent attribute."""
    config_class = model.config_class
    known = config_arguments(config_class)
    for name in arguments:
        if name not in known:
            raise UsageError(f"{config_class.__name__} has no argument {name!r}"
                             f"{_did_you_mean(name, sorted(known))}")
    try:
        return config_class(**arguments)
    except Exception as exc:  # noqa: BLE001 - a config may refuse a value with any error
        reason = " ".join(str(exc).split())
        raise UsageError(f"{config_class.__name__}: {reason}") from None


class HFModelConfig(BaseModel):
    """A transformers model built from its config (no download): the ``model.hf`` section."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True,
                              populate_by_name=True, serialize_by_alias=True)

    model_class: str = Field(alias="class")
    """A transformers model class, e.g. GPT2LMHeadModel, LlamaForCausalLM, BertForMaskedLM."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Arguments of the class's config (GPT2Config: n_layer, n_embd, ...); the rest keep
    transformers' defaults."""
    seed: int = 0
    """The random initial weights depend on this seed only."""

    @model_validator(mode="after")
    def _known(self) -> HFModelConfig:
        build_config(model_class(self.model_class), self.config)
        return self


def build_model(spec: HFModelConfig) -> nn.Module:
    """The model ``spec`` describes, with random weights drawn from ``spec.seed`` (the
    global random state is left as it was)."""
    cls = model_class(spec.model_class)
    config = build_config(cls, spec.config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        return cls(config)
