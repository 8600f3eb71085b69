"""Reading a committed checkpoint back into plain tensors and objects, verifying as it reads.

The top reading layer: whole items by key. Plain records are read through :mod:`tiers.reading.pieces`
(every frame's checksum recomputed from the bytes actually read, uncompressed frames scattered
straight into the item buffers) and decoded; sharded tensors are reassembled through
:mod:`tiers.reading.reshard`. Each tensor returned is a buffer of its own that nothing else references,
except that an alias (a tied tensor) is the very tensor of its target.
"""

from __future__ import annotations

from typing import Any

import torch

from ..format.dtypes import dtype_from_name
from ..format.format import ManifestError, MissingItemError
from ..format.gcpause import gc_paused
from ..format.manifest import Manifest
from ..format.objcodec import decode_object
from ..format.records import ObjectRecord, ShardedRecord, TensorRecord, stored_key
from .boxes import Box
from .pieces import CorruptCheckpointError as CorruptCheckpointError  # what a read raises on a damaged copy
from .pieces import ReadTooLargeError, read_records
from .reshard import Region, global_shape, read_regions
from .source import ByteSource

#: What reading one copy of a checkpoint fails with when that copy is at fault (invalid, damaged,
#: unreadable, too large for this machine, without the items asked for): a restore then tries the
#: next copy. An object refused by policy (pickle) is not among them: every copy would be refused.
#: Public as :attr:`tiers.reading.stored.StoredCheckpoint.COPY_ERRORS`.
COPY_ERRORS = (ManifestError, CorruptCheckpointError, ReadTooLargeError, MissingItemError, OSError)


@gc_paused()  # a buffer, a view and a record per item: see tiers/format/gcpause.py
def read_view(
    source: ByteSource, view: Manifest, wanted: list[str], allow_pickle: bool = False, workers: int = 4
) -> dict[str, Any]:
    """Items ``wanted`` of a rank's ``view`` (:func:`tiers.format.multirank.rank_view`), its copy already admitted
    (:func:`tiers.reading.integrity.admit`)."""
    stored = dict.fromkeys(stored_key(key, view.items[key]) for key in wanted)  # in order, each once
    sharded = {key: record for key in sorted(stored) if isinstance(record := view.items[key], ShardedRecord)}
    plain: dict[str, TensorRecord | ObjectRecord] = {
        key: record for key in stored if isinstance(record := view.items[key], TensorRecord | ObjectRecord)
    }
    buffers = read_records(source, view, plain, workers)
    values = {key: _decode(record, buffers[key], allow_pickle) for key, record in plain.items()}
    if sharded:
        regions = [Region(key, record, Box.whole(global_shape(record))) for key, record in sharded.items()]
        values.update(zip(sharded, read_regions(source, view, regions, workers).tensors, strict=True))
    return {key: values[stored_key(key, view.items[key])] for key in wanted}


def _decode(record: TensorRecord | ObjectRecord, buffer: torch.Tensor, allow_pickle: bool) -> Any:
    if isinstance(record, ObjectRecord):
        return decode_object(bytes(buffer.numpy()), record.serializer, allow_pickle)
    return buffer.view(dtype_from_name(record.dtype)).reshape(record.shape)
