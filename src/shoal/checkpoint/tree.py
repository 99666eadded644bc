"""Split a nested state (dicts, lists, numbers, tensors) into tensors and a JSON skeleton.

DCP stores tensors by itself and everything else by pickling it, and its default loader
unpickles with ``weights_only=False``. shoal gives DCP tensors only and keeps the structure,
numbers and strings in JSON, so loading a checkpoint never runs pickled code.
"""

from __future__ import annotations

import math
from typing import Any

import torch

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_FLOAT = "__float__"


def split(obj: Any, prefix: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON-able skeleton, flat {key: tensor}); tensor keys start with ``prefix``."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            tensors[path] = node
            return {_TENSOR: path}
        if isinstance(node, dict):
            if not all(isinstance(k, (str, int)) for k in node):
                raise TypeError(f"{path}: only str or int keys can be checkpointed")
            # JSON keys are strings: remember which were ints.
            return {"__dict__": [[k, walk(v, f"{path}.{k}")] for k, v in node.items()]}
        if isinstance(node, (list, tuple)):
            items = [walk(v, f"{path}.{i}") for i, v in enumerate(node)]
            return {_TUPLE: items} if isinstance(node, tuple) else items
        if isinstance(node, float) and not math.isfinite(node):
            return {_FLOAT: repr(node)}
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise TypeError(f"{path}: cannot checkpoint a {type(node).__name__} without pickling")

    return walk(obj, prefix), tensors


def join(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Rebuild the nested state from ``split``'s output (a tensor not in ``tensors`` is
    None)."""
    if isinstance(skeleton, list):
        return [join(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            return tensors.get(skeleton[_TENSOR])
        if _TUPLE in skeleton:
            return tuple(join(v, tensors) for v in skeleton[_TUPLE])
        if _FLOAT in skeleton:
            return float(skeleton[_FLOAT])
        return {k: join(v, tensors) for k, v in skeleton["__dict__"]}
    return skeleton


def tensor_keys(skeleton: Any) -> list[str]:
    """Every tensor key the skeleton refers to."""
    if isinstance(skeleton, list):
        return [k for v in skeleton for k in tensor_keys(v)]
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            return [skeleton[_TENSOR]]
        if _TUPLE in skeleton:
            return tensor_keys(skeleton[_TUPLE])
        if _FLOAT in skeleton:
            return []
        return [k for _, v in skeleton["__dict__"] for k in tensor_keys(v)]
    return []


def merge(first: Any, other: Any) -> Any:
    """The union of two skeletons of one kind of state held in parts (pipeline stages each
    hold some parameters): dict keys of both, lists of names of both (in order), lists of
    equal length merged item by item; anywhere else ``first`` wins."""
    if isinstance(first, dict) and isinstance(other, dict) and "__dict__" in first \
            and "__dict__" in other:
        theirs = dict((k, v) for k, v in other["__dict__"])
        mine = [[k, merge(v, theirs[k]) if k in theirs else v] for k, v in first["__dict__"]]
        known = {k for k, _ in first["__dict__"]}
        return {"__dict__": mine + [[k, v] for k, v in other["__dict__"] if k not in known]}
    if isinstance(first, list) and isinstance(other, list):
        if all(isinstance(v, str) for v in first + other):
            return first + [v for v in other if v not in first]
        if len(first) == len(other):
            return [merge(a, b) for a, b in zip(first, other, strict=True)]
    return first
