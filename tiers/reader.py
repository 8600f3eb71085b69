"""Reading a committed checkpoint back into plain tensors and objects, verifying as it reads.

The top reading layer: whole items by key. Plain records are read through :mod:`tiers.pieces`
(every frame's checksum recomputed from the bytes actually read, uncompressed frames scattered
straight into the item buffers) and decoded; sharded tensors are reassembled through
:mod:`tiers.reshard`. Each tensor returned is a buffer of its own that nothing else references,
except that an alias (a tied tensor) is the very tensor of its target.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from .boxes import Box
from .dtypes import dtype_from_name
from .format import (
    Manifest,
    ManifestError,
    MissingItemError,
    ObjectRecord,
    ShardedRecord,
    TensorRecord,
    read_manifest,
    stored_key,
)
from .gcpause import gc_paused
from .multirank import rank_view
from .objcodec import decode_object
from .pieces import CorruptCheckpointError as CorruptCheckpointError  # what load and read_items raise
from .pieces import ReadTooLargeError, check_file_sizes, read_records
from .reshard import Region, global_shape, read_regions

#: What reading one copy of a checkpoint fails with when that copy is at fault (invalid, damaged,
#: unreadable, too large for this machine, without the items asked for): a restore then tries the
#: next copy. An object refused by policy (pickle) is not among them: every copy would be refused.
COPY_ERRORS = (ManifestError, CorruptCheckpointError, ReadTooLargeError, MissingItemError, OSError)


@gc_paused()  # a buffer, a view and a record per item: see tiers/gcpause.py
def read_items(
    directory: Path,
    manifest: Manifest | None = None,
    keys: Iterable[str] | None = None,
    allow_pickle: bool = False,
    workers: int = 4,
) -> dict[str, Any]:
    """Read items (all by default) of the checkpoint in ``directory``: key -> tensor (CPU) or object.

    Of a multi-rank checkpoint, sharded tensors come back whole and per-rank items as rank 0's.
    """
    manifest = manifest or read_manifest(directory)
    wanted = list(manifest.items) if keys is None else list(keys)
    unknown = [k for k in wanted if k not in manifest.items]
    if unknown:
        raise MissingItemError(f"{directory}: no item(s) {', '.join(unknown[:8])}")
    check_file_sizes(directory, manifest)
    view = rank_view(manifest, 0, wanted)
    stored = dict.fromkeys(stored_key(key, view.items[key]) for key in wanted)  # in order, each once
    sharded = {key: record for key in sorted(stored) if isinstance(record := view.items[key], ShardedRecord)}
    plain: dict[str, TensorRecord | ObjectRecord] = {
        key: record for key in stored if isinstance(record := view.items[key], TensorRecord | ObjectRecord)
    }
    buffers = read_records(directory, view, plain, workers)
    values = {key: _decode(record, buffers[key], allow_pickle) for key, record in plain.items()}
    if sharded:
        regions = [Region(key, record, Box.whole(global_shape(record))) for key, record in sharded.items()]
        values.update(zip(sharded, read_regions(directory, view, regions, workers).tensors, strict=True))
    return {key: values[stored_key(key, view.items[key])] for key in wanted}


def _decode(record: TensorRecord | ObjectRecord, buffer: torch.Tensor, allow_pickle: bool) -> Any:
    if isinstance(record, ObjectRecord):
        return decode_object(bytes(buffer.numpy()), record.serializer, allow_pickle)
    return buffer.view(dtype_from_name(record.dtype)).reshape(record.shape)


def load(path: str | os.PathLike[str], allow_pickle: bool = False) -> dict[str, Any]:
    """The plain state of one committed checkpoint directory, without a runner: key -> value."""
    return read_items(Path(path), allow_pickle=allow_pickle)
