"""Tensors as items, whether plain or ``DTensor`` (FSDP2, tensor parallel): a DTensor describes itself.

A DTensor knows its global shape and how it is laid out on its device mesh, so its item is its
local tensor with a :class:`ShardInfo` placing it in the global tensor, marked replicated when a
mesh dimension replicates it (several ranks hold the same piece, one copy is enough). On restore
the local values are wrapped back into a DTensor of the live tensor's layout, because
``load_state_dict`` cannot copy a plain tensor into a DTensor parameter.

State that does not exist yet has no live tensor to describe: a fresh optimizer has no state
before its first step. Its state shaped like a DTensor parameter will be laid out like that
parameter, so :func:`layout_target` stands in for it on restore, holding no memory.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from .items import Changes, ShardInfo, TensorItem

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """Whether ``value`` is a DTensor; False in a torch built without distributed (none can exist there).

    Called for every tensor a plan is made of (10^5 for large optimizer states), so a plain tensor is
    answered by its type alone, and the class is looked up, never imported: no DTensor exists before its
    module is imported (which costs ~1 s)."""
    if type(value) in _PLAIN:
        return False
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(value, dtensor)


def storage_of(tensor: torch.Tensor) -> int:
    """The address of the memory a tensor's values live in (a DTensor's: its local shard's), worked out from
    the tensor's own: ``untyped_storage()`` builds a Python object at every call (~2 us, against ~0.3 us),
    and a restore or a plan asks this of each of 10^5 tensors."""
    local = tensor.to_local() if is_dtensor(tensor) else tensor
    return local.data_ptr() - int(local.storage_offset()) * local.element_size()


def tensor_item(key: str, tensor: torch.Tensor, replicated: bool = False, changes: Changes = "any") -> TensorItem:
    """The item of ``tensor``; ``replicated`` applies to plain tensors, a DTensor's layout decides its own."""
    if not is_dtensor(tensor):
        return TensorItem(key, tensor, replicated=replicated, changes=changes)
    shard, copies = _layout(key, tensor)
    return TensorItem(key, tensor.to_local(), shard=shard, replicated=copies, changes=changes)


def layout_target(key: str, like: DTensor) -> TensorItem:
    """An item for a tensor that does not exist yet but will be laid out like the DTensor ``like``.

    Its tensor is on the meta device (no memory), with the local shape this rank will hold; its
    shard places that part in the global tensor, which is all a restore needs to read just it.
    """
    shard, copies = _layout(key, like)
    part = torch.empty(like.to_local().shape, dtype=like.dtype, device="meta")
    return TensorItem(key, part, shard=shard, replicated=copies)


def _layout(key: str, tensor: DTensor) -> tuple[ShardInfo | None, bool]:
    """Where the DTensor ``tensor``'s local part sits (None: it is whole), and whether other ranks hold copies."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    placements = tensor.placements
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(
            f"item {key!r}: a DTensor with a Partial placement holds unreduced values; "
            "redistribute it to Shard or Replicate before checkpointing"
        )
    if any(type(p) not in (Shard, Replicate) for p in placements):  # e.g. _StridedShard: not one box per rank
        raise ValueError(f"item {key!r}: DTensor placements {placements} are not plain Shard/Replicate")
    mesh = tensor.device_mesh
    _, offsets = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    sharded = any(isinstance(p, Shard) for p in placements)
    copies = any(isinstance(p, Replicate) and mesh.size(dim) > 1 for dim, p in enumerate(placements))
    return (ShardInfo(tuple(tensor.shape), tuple(offsets)) if sharded else None), copies


def like_live(live: Any, value: Any) -> Any:
    """``value`` (this rank's local part, read back) in the form of ``live``: a DTensor if it is one."""
    if not is_dtensor(live) or not isinstance(value, torch.Tensor):
        return value
    local = value.to(live.to_local().device)
    return type(live).from_local(
        local, live.device_mesh, live.placements, run_check=False, shape=live.shape, stride=live.stride()
    )
