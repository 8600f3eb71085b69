"""Whether a provider's cheap listing (a :class:`~providers.items.TensorBatch`) is what its ``describe()``
gives, and whether two listings name the very same tensor objects: the checks that let plan_cache.py reuse a
plan instead of describing 10^5 items at every checkpoint. Comparisons run in C loops where they can.
"""

from __future__ import annotations

import operator

import torch

from ..providers.dtensor import is_dtensor, storage_of
from ..providers.items import Item, ObjectItem, TensorBatch, TensorItem

FORM = operator.attrgetter("dtype", "shape", "device")  # what a plan fixes of a tensor


def same_batches(new: dict[str, TensorBatch], old: dict[str, TensorBatch]) -> bool:
    """Whether ``new`` lists the very tensor objects of ``old``, under the same keys and ``changes``."""
    if new.keys() != old.keys():
        return False
    for path, batch in new.items():
        was = old[path]
        if batch.tensors is was.tensors and batch.keys is was.keys and batch.changes is was.changes:
            continue  # the very listing (a deferred optimizer's, a module's unchanged): no object to touch
        if (
            batch.changes != was.changes
            or len(batch.tensors) != len(was.tensors)
            or batch.keys != was.keys
            or not all(map(operator.is_, batch.tensors, was.tensors))
        ):
            return False
    return True


def as_described(batch: TensorBatch, described: list[Item], prefix: str) -> list[TensorItem] | None:
    """The batch's tensors as ``describe()`` describes them (shard, replication, ``changes``), each holding the
    batch's own object, keyed after ``prefix``; None unless ``describe()`` gives exactly the batch's items and
    ``others``, alike."""
    by_key = {item.key: item for item in described}
    others = {item.key: item for item in batch.others}
    if len(by_key) != len(described) or len(others) + len(batch.keys) != len(by_key):
        return None
    if by_key.keys() != {*batch.keys, *others}:
        return None
    items = []
    for index, (key, tensor) in enumerate(zip(batch.keys, batch.tensors, strict=True)):
        item = by_key[key]
        if not isinstance(item, TensorItem) or item.changes != batch.changes_of(index):
            return None
        if not _same_view(item.tensor, tensor):
            return None
        item.key, item.tensor = prefix + key, tensor  # describe()'s own item, already checked: reused
        items.append(item)
    if not all(_alike(by_key[key], other) for key, other in others.items()):
        return None
    return items


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are one object, or plain tensors viewing the same memory alike (a detached alias)."""
    if a is b:
        return True
    if is_dtensor(a) or is_dtensor(b):
        return False
    return (
        FORM(a) == FORM(b)
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and storage_of(a) == storage_of(b)
    )


def _alike(described: Item, listed: Item) -> bool:
    """Whether an item listed afresh with a batch is what ``describe()`` gave (same kind, options and value)."""
    if isinstance(described, TensorItem) and isinstance(listed, TensorItem):
        return _same_view(described.tensor, listed.tensor) and described.changes == listed.changes
    if isinstance(described, ObjectItem) and isinstance(listed, ObjectItem):
        try:
            same = bool(described.value == listed.value)
        except Exception:  # a value whose comparison fails or is not a truth value: not known to be alike
            return False
        return same and (described.serializer, described.replicated) == (listed.serializer, listed.replicated)
    return False
