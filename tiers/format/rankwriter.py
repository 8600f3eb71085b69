"""One rank's files of one checkpoint: its data file in either container, its index, its manifest part.

The persist stage only hands over chunks; everything about the on-disk format is settled here.
The container (:mod:`tiers.format.container`) stores the chunks and reports where each item range went;
once all are written, :meth:`RankWriter.finish` makes the data file durable and
:meth:`RankWriter.write_index` writes the index and returns this rank's manifest in JSON form,
ready for the commit. Every method blocks; none retries or translates errors, which is the
caller's choice (the pipeline retries transient ones and names the tier).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Mapping
from operator import itemgetter
from pathlib import Path
from typing import Any

from ..storage.safeopen import write_durably
from .container import Chunk, ContainerWriter, Format, Layout
from .format import ManifestBody, alias_body, checksum, index_bytes, manifest_body, object_body, tensor_body
from .framefile import FrameFile
from .gcpause import gc_paused
from .hdf5 import Hdf5Container
from .names import data_file_name, hdf5_file_name, index_file_name
from .records import FileRecord


def data_file_path(directory: Path, rank: int, fmt: Format) -> Path:
    """Where rank ``rank``'s data file in container ``fmt`` goes in ``directory``."""
    return directory / (hdf5_file_name(rank) if fmt == "hdf5" else data_file_name(rank))


def open_container(
    path: Path, fmt: Format, align: int, layout: Layout, attrs: Mapping[str, Any], io: str = "auto"
) -> ContainerWriter:
    """A new data file at ``path`` in container ``fmt``; ``attrs`` label an HDF5 file, ``io`` picks
    O_DIRECT or buffered frames (see :mod:`tiers.format.framefile`)."""
    if fmt == "hdf5":
        return Hdf5Container(path, align, attrs, layout)
    return FrameFile(path, align, io)


class RankWriter:
    """The data file and index of rank ``rank`` for checkpoint ``step``, written into ``directory``.

    ``write`` may run in many threads at once and, after it raised, be repeated with the same chunk.
    """

    def __init__(
        self,
        directory: Path,
        rank: int,
        step: int,
        layout: Layout,
        fmt: Format = "frames",
        align: int = 4096,
        io: str = "auto",
        container: ContainerWriter | None = None,
    ) -> None:
        """``container``: the data file, opened already (a memory tier's slot); else a new one in ``directory``."""
        self.rank = rank
        self.step = step
        self.index_path = directory / index_file_name(rank)
        self._layout = layout
        self.container = container or open_container(
            data_file_path(directory, rank, fmt), fmt, align, layout, {"step": step, "rank": rank}, io
        )
        self._pieces: defaultdict[str, list[dict[str, Any]]] = defaultdict(list)
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        return self.container.path

    def write(self, chunk: Chunk) -> None:
        """Store ``chunk`` in the data file and remember where its item ranges went."""
        pieces = self.container.write(chunk)
        with self._lock:
            for key, piece in pieces:
                self._pieces[key].append(piece)

    def finish(self) -> FileRecord:
        """Make the data file durable and close it; its record. Never repeat it (see the container)."""
        return self.container.finish()

    def write_index(self, file: FileRecord) -> ManifestBody:
        """Write the index durably; this rank's manifest body, naming the index. Safe to repeat."""
        with gc_paused():  # a record per item, while the trainer runs: see tiers/format/gcpause.py
            items = self._items()
            index = index_bytes(self.rank, self.step, file, items)
            manifest = manifest_body(self.step, {self.container.name: file}, items)
        write_durably(self.index_path, index)
        manifest["indexes"] = {self.index_path.name: checksum(index)}
        return manifest

    def close(self) -> None:
        """Abandon the data file after a failure."""
        self.container.close()

    def _items(self) -> dict[str, dict[str, Any]]:
        """Every item of the layout in JSON form, with its pieces in item order."""
        items: dict[str, dict[str, Any]] = {}
        for key, tensor in self._layout.tensors.items():
            pieces = self._pieces.get(key, [])
            if len(pieces) > 1:  # most of 10^5 small tensors have one piece: nothing to sort
                pieces = sorted(pieces, key=itemgetter("item_offset"))
            items[key] = tensor_body(tensor.dtype, tensor.shape, pieces, tensor.shard)
        for key, serializer in self._layout.objects.items():
            pieces = sorted(self._pieces.get(key, []), key=itemgetter("item_offset"))
            items[key] = object_body(serializer, sum(p["length"] for p in pieces), pieces)
        for key, target in self._layout.aliases.items():
            items[key] = alias_body(target)
        return items
