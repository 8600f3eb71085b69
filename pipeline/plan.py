"""Planning a checkpoint: which bytes of which tensor go into which chunk.

Tensors are packed end to end into chunks of ``chunk_size`` bytes: many small tensors share one
chunk (so the disk sees a few large writes, not thousands of small ones) and a tensor larger than
a chunk is split across several (so it streams through a host cache smaller than itself). The same
tensor registered under two keys (tied weights) is planned once and recorded as an alias.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..providers.dtensor import storage_of
from ..providers.items import ObjectItem, TensorItem
from ..tiers.format.container import TensorLayout
from ..tiers.format.dtypes import dtype_name
from .units import ChunkPlan, TensorPiece

ITEM_ALIGN = 64


@dataclass
class CheckpointPlan:
    tensors: list[TensorItem]
    objects: list[ObjectItem]
    aliases: dict[str, str]  # key -> key of the identical tensor that is stored
    chunks: list[ChunkPlan]
    # The form each tensor is stored under, when fixed at planning (a reused plan, plan_cache.py);
    # otherwise read from the items' tensors when the job starts.
    layouts: dict[str, TensorLayout] = field(default_factory=dict)

    @property
    def tensor_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


def tensor_layout(item: TensorItem) -> TensorLayout:
    """How ``item`` is recorded in the manifest: its dtype, shape and shard."""
    shard = None if item.shard is None else (list(item.shard.global_shape), list(item.shard.offsets))
    return TensorLayout(dtype_name(item.tensor.dtype), list(item.tensor.shape), shard)


def _identity(t: torch.Tensor) -> tuple:
    return (t.device, t.dtype, storage_of(t), t.storage_offset(), tuple(t.shape), t.stride())


def plan_checkpoint(items: list, chunk_size: int) -> CheckpointPlan:
    tensors: list[TensorItem] = []
    objects: list[ObjectItem] = []
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    keys: set[str] = set()
    for item in items:
        if item.key in keys:
            raise ValueError(f"two items share the key {item.key!r}")
        keys.add(item.key)
        if isinstance(item, ObjectItem):
            objects.append(item)
            continue
        if item.tensor.is_quantized:
            raise TypeError(f"item {item.key!r}: quantized tensors are not supported; store their int_repr and scales")
        ident = _identity(item.tensor)
        if item.tensor.numel() and ident in seen and item.shard is None:
            aliases[item.key] = seen[ident]
            continue
        seen.setdefault(ident, item.key)
        tensors.append(item)
    return CheckpointPlan(tensors, objects, aliases, _pack(tensors, chunk_size))


def _align(n: int) -> int:
    return -(-n // ITEM_ALIGN) * ITEM_ALIGN


def _pack(tensors: list[TensorItem], chunk_size: int) -> list[ChunkPlan]:
    chunks = [ChunkPlan(0)]
    for item in tensors:
        offset, remaining = 0, item.nbytes
        if remaining:
            # Each tensor starts aligned, so the slab bytes can be viewed as its dtype for a strided copy.
            chunks[-1].nbytes = min(_align(chunks[-1].nbytes), chunk_size)
        while remaining:
            current = chunks[-1]
            if current.nbytes == chunk_size:
                current = ChunkPlan(len(chunks))
                chunks.append(current)
            length = min(remaining, chunk_size - current.nbytes)
            current.pieces.append(TensorPiece(item, offset, length, current.nbytes))
            current.nbytes += length
            offset += length
            remaining -= length
    for chunk in chunks:
        if chunk.pieces:  # trailing alignment padding is not written
            chunk.nbytes = chunk.pieces[-1].chunk_offset + chunk.pieces[-1].length
    return [c for c in chunks if c.pieces]
