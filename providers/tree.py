"""Split a nested state (dicts, lists, tuples) into tensors and a tensor-free skeleton, and back.

``state_dict()`` of optimizers, schedulers and similar objects mixes tensors, which the pipeline
copies lazily and stores as raw bytes, with small Python values, which are serialized as one
object. The skeleton keeps the structure and puts a marker where each tensor was.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, cast

import torch

from .base import RestoreError, shown
from .dtensor import tensor_item
from .items import TensorItem

TENSOR_MARKER = "__tierstate_tensor__"
"""The only key of the dict that stands in for a tensor in a skeleton; its value is the item key."""

_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes)


def split_tensors(obj: Any, key_prefix: str = "", replicated: bool = False) -> tuple[Any, list[TensorItem]]:
    """Return ``(skeleton, tensor items)`` for a nested dict/list/tuple.

    Tensors are referenced, not cloned: capture is lazy. The skeleton is rebuilt (containers
    fresh, other non-primitive leaves deep-copied) so that later changes to the live state, such as
    a scheduler writing ``lr`` into ``param_groups``, do not leak into a checkpoint already requested.
    Item keys are the path parts joined with ``/``, after ``key_prefix`` when one is given.
    ``replicated`` marks the plain tensors as the same on every rank (DTensors say it themselves).
    """
    items: list[TensorItem] = []
    seen: set[str] = set()
    root = (key_prefix,) if key_prefix else ()

    def walk(node: Any, path: tuple[str, ...]) -> Any:
        if isinstance(node, torch.Tensor):
            key = "/".join(path)
            if not key:
                raise ValueError("a tensor at the root of the state needs a key_prefix")
            if key in seen:
                raise ValueError(f"two tensors map to the item key {key!r}; rename the keys that collide")
            seen.add(key)
            items.append(tensor_item(key, node, replicated))
            return {TENSOR_MARKER: key}
        if isinstance(node, Mapping):
            if TENSOR_MARKER in node:
                raise ValueError(f"state at {'/'.join(path)!r} uses the reserved key {TENSOR_MARKER!r}")
            return {k: walk(v, (*path, str(k))) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            children = [walk(v, (*path, str(i))) for i, v in enumerate(node)]
            return _rebuild_sequence(node, children)
        if isinstance(node, _IMMUTABLE):
            return node
        return copy.deepcopy(node)

    skeleton = walk(obj, root)
    return skeleton, items


def join_tensors(skeleton: Any, tensors: Mapping[str, torch.Tensor], owner: str = "checkpoint") -> Any:
    """Inverse of :func:`split_tensors`: put ``tensors[key]`` back where each marker is.

    Raises :class:`RestoreError` naming every missing key (``owner`` says whose state it is).
    """
    missing: list[str] = []

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if len(node) == 1 and TENSOR_MARKER in node:
                key = node[TENSOR_MARKER]
                if key not in tensors:
                    missing.append(key)
                return tensors.get(key)
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return _rebuild_sequence(node, [walk(v) for v in node])
        return node

    joined = walk(skeleton)
    if missing:
        raise RestoreError(f"{owner}: checkpoint lacks {len(missing)} tensor(s): {shown(missing)}")
    return joined


def _rebuild_sequence(original: list | tuple, children: list[Any]) -> list | tuple:
    """Keep tuples tuples (``betas`` in Adam) and namedtuples their type; every other sequence is a list."""
    if isinstance(original, tuple):
        # a namedtuple rebuilds itself with its own _make
        return cast(Any, original)._make(children) if hasattr(original, "_fields") else tuple(children)
    return children
