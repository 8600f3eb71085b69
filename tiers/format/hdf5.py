"""The HDF5 container: one ordinary HDF5 file per rank that h5py, HDFView or MATLAB can open.

Each tensor is a dataset (its key is the HDF5 path, so ``model/fc.weight`` lands in group
``model``) with ``dtype`` and ``shape`` attributes; each object is a byte dataset with a
``serializer`` attribute; tied tensors are hard links. Datasets are contiguous and allocated when
created, so their byte ranges are known up front and the tensor bytes are written there with plain
``pwrite`` calls, as frames, exactly like the frames format: the manifest, the commit protocol,
the reader, ``verify`` and ``migrate`` need nothing HDF5-specific. The bytes the HDF5 library
writes itself (superblock, object headers) become frames too, so every byte of the file is covered
by a checksum. It is a :class:`~tiers.format.container.ContainerWriter`: a chunk that coalesces several
items is written as one frame per entry, each at its dataset's address. Frames are written raw,
so chunks must arrive uncompressed.

HDF5 has no bfloat16, float8 or sub-byte integer types. Those tensors are stored as raw bytes in
an unsigned integer dataset of the same element size (uint16 for bfloat16) with the tensor's shape,
``dtype`` naming the real type and ``raw`` set to true; ``x.view(torch.bfloat16)`` on the values
read back restores them.

h5py is an optional dependency, imported when a container is first made (tiers/format/hdf5_extra.py).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tierstate.errors import TierstateError

from ..storage.safeopen import check_absent
from .container import Chunk, ItemPiece, Layout
from .dtypes import dtype_from_name
from .format import piece_body
from .framefile import FrameFile
from .hdf5_extra import h5py_module
from .records import FileRecord, ShardRecord

FORMAT_ATTR = "tierstate-hdf5"

# Types numpy (and so h5py) store natively, with the same bytes as torch in memory.
_NATIVE = {
    name: np.dtype(name)
    for name in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
}
_UNSIGNED = {1: np.dtype("uint8"), 2: np.dtype("uint16"), 4: np.dtype("uint32"), 8: np.dtype("uint64")}


class Hdf5LayoutError(TierstateError, ValueError):
    """An item key or dtype that cannot become an HDF5 dataset; names the key."""


def dataset_dtype(name: str) -> tuple[np.dtype, bool]:
    """The dataset type for a torch dtype name, and whether it holds raw bytes of another type."""
    if name in _NATIVE:
        return _NATIVE[name], False
    itemsize = dtype_from_name(name).itemsize
    if itemsize not in _UNSIGNED:
        raise Hdf5LayoutError(f"dtype {name} ({itemsize} bytes per element) has no HDF5 equivalent")
    return _UNSIGNED[itemsize], True


class Hdf5Container:
    """One HDF5 file being written: datasets are declared first, then their bytes arrive as frames.

    ``layout`` declares its tensors now, each of its objects when its bytes arrive (whole, in one
    entry: only then is its length known) and its aliases at :meth:`finish`; ``add_*`` declare
    more. ``write`` may be called from many threads at once; declaring datasets goes through h5py,
    which serializes itself.
    """

    def __init__(
        self,
        path: Path,
        align: int,
        attrs: Mapping[str, Any],
        layout: Layout | None = None,
        *,
        replace: bool = False,
    ) -> None:
        layout = layout or Layout()
        # Inside a tier the file must be new: mode "x" creates it with O_EXCL, so HDF5 never writes
        # through a symlink planted under its name (see tiers.storage.safeopen); ``replace`` (an export's
        # file, outside the tiers) truncates an existing one.
        if not replace:
            check_absent(path)  # a clear error first; HDF5's own O_EXCL closes the race
        # Datasets of at least `align` bytes start at multiples of it: O_DIRECT-friendly, like frames.
        mode = "w" if replace else "x"
        self._h5 = h5py_module().File(path, mode, alignment_threshold=align, alignment_interval=align)
        self.path = path
        self.name = path.name
        self._offsets: dict[str, int | None] = {}
        self._lock = threading.Lock()
        self._objects = dict(layout.objects)
        self._aliases = dict(layout.aliases)
        try:
            self._h5.attrs["format"] = FORMAT_ATTR
            for key, value in attrs.items():
                self._h5.attrs[key] = value
            self._frames = FrameFile(path, align, io="buffered", create=False)
        except BaseException:
            self._h5.close()
            raise
        try:
            for key, tensor in layout.tensors.items():
                shard = None
                if tensor.shard is not None:
                    shard = ShardRecord(global_shape=tensor.shard[0], offsets=tensor.shard[1])
                self.add_tensor(key, tensor.dtype, tensor.shape, shard)
        except BaseException:
            self.close()
            raise

    def add_tensor(self, key: str, dtype: str, shape: Sequence[int], shard: ShardRecord | None = None) -> None:
        stored, raw = dataset_dtype(dtype)
        attrs: dict[str, Any] = {"kind": "tensor", "dtype": dtype, "shape": np.array(shape, dtype=np.int64), "raw": raw}
        if shard is not None:
            attrs["shard_global_shape"] = np.array(shard.global_shape, dtype=np.int64)
            attrs["shard_offsets"] = np.array(shard.offsets, dtype=np.int64)
        self._create(key, tuple(shape), stored, attrs)

    def add_object(self, key: str, serializer: str, length: int) -> None:
        """A byte dataset for an encoded object (declared once its encoded length is known)."""
        self._create(key, (length,), np.dtype("uint8"), {"kind": "object", "serializer": serializer})

    def add_alias(self, key: str, target: str) -> None:
        """A tied tensor: a hard link, so both names open the very same dataset."""
        self._check_key(key)
        try:
            self._h5[key] = self._h5[target]
        except (ValueError, KeyError, TypeError) as exc:
            raise Hdf5LayoutError(f"item {key!r} (alias of {target!r}): cannot link in HDF5: {exc}") from None

    @staticmethod
    def _check_key(key: str) -> None:
        if any(part in ("", ".", "..") for part in key.split("/")):
            raise Hdf5LayoutError(f"item {key!r}: not a valid HDF5 path (empty, '.' or '..' component)")

    def _create(self, key: str, shape: tuple[int, ...], dtype: np.dtype, attrs: Mapping[str, Any]) -> None:
        self._check_key(key)
        h5py = h5py_module()
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.CONTIGUOUS)
        dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
        try:
            dataset = self._h5.create_dataset(
                key, shape=shape, dtype=dtype, dcpl=dcpl, fill_time="never", track_times=False
            )
        except (ValueError, TypeError, KeyError) as exc:  # name taken, or a parent is a dataset
            raise Hdf5LayoutError(f"item {key!r}: cannot become an HDF5 dataset: {exc}") from None
        dataset.attrs.update(attrs)
        offset = dataset.id.get_offset()
        if offset is None and math.prod(shape):
            # HDF5 allocates nothing for a scalar at creation; one write through the library does,
            # and the flush pushes it out before any of our own writes can land there.
            dataset[()] = np.zeros(shape, dtype)
            self._h5.flush()
            offset = dataset.id.get_offset()
        with self._lock:
            self._offsets[key] = offset

    def write(self, chunk: Chunk) -> list[ItemPiece]:
        """Write each entry of ``chunk`` into its dataset, as one frame; where each piece now lies."""
        if chunk.stored is not None:
            raise ValueError(f"{self.path}: HDF5 datasets hold raw bytes, but a chunk arrived compressed")
        pieces = []
        for entry in chunk.entries:
            if entry.key in self._objects and entry.key not in self._offsets:  # not yet declared by a try before
                self.add_object(entry.key, self._objects[entry.key], entry.length)
            if not entry.length:
                continue
            base = self._offsets[entry.key]
            if base is None:
                raise Hdf5LayoutError(f"item {entry.key!r}: dataset has no storage for {entry.length} bytes")
            data = chunk.raw[entry.chunk_offset : entry.chunk_offset + entry.length]
            frame = self._frames.put(base + entry.item_offset, data)
            pieces.append((entry.key, piece_body(self.name, frame, 0, entry.length, entry.item_offset)))
        return pieces

    def finish(self) -> FileRecord:
        """Link tied tensors, close the HDF5 file, checksum the library's own bytes as frames, fsync;
        the file's record."""
        for key, target in self._aliases.items():
            self.add_alias(key, target)
        self._h5.close()
        size = self._frames.file_size()
        position = 0
        for frame in self._frames.frames:
            if frame.offset > position:
                self._frames.adopt(position, frame.offset - position)
            position = max(position, frame.offset + frame.length)
        if position < size:
            self._frames.adopt(position, size - position)
        return self._frames.finish(size)

    def close(self) -> None:
        """Abandon the file (after a failure): release the HDF5 handle and our descriptor."""
        if self._h5.id.valid:
            self._h5.close()
        self._frames.close()
