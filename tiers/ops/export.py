"""``tierstate export``: one checkpoint as a single HDF5 or safetensors file for analysis tools.

Model-evolution studies read one tensor across many steps; they want files their own tools open
(h5py, safetensors) without tierstate. An export holds every item under its key, in its logical
form: sharded tensors reassembled whole, per-rank items as rank 0's value (as ``tiers.reading.stored.load``
gives them); every byte is verified against its checksum on the way out.

- HDF5: the same layout as an HDF5 checkpoint (see :mod:`tiers.format.hdf5`): a dataset per tensor with
  ``dtype`` and ``shape`` attributes, objects as byte datasets with a ``serializer`` attribute, tied
  tensors as hard links. bfloat16 and other types HDF5 lacks are raw bytes in an unsigned integer
  dataset of the same element size, marked ``raw`` (``torch.from_numpy(x).view(torch.bfloat16)``).
- safetensors: tensors natively where safetensors has the type (bfloat16 and float8 included);
  other types as raw unsigned integers of the same element size, objects as uint8 tensors of their
  encoded bytes. The header metadata (``tierstate.*`` keys, JSON values) names the real dtype of
  raw tensors, the serializer of objects, and the aliases, which are not stored twice.
- hf: a Hugging Face model directory (tiers/ops/hfdir.py), the weights of one provider alone.

``provider`` narrows an export to one provider's items (``model``: the keys under ``model/``), named
without that prefix, as the object itself names them in its ``state_dict``.

The file appears whole or not at all: it is written under a temporary name beside ``out`` and renamed
over it when complete, with the permissions a new file gets here (0666 less the umask).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from ..format.convert import write_sliced
from ..format.dtypes import dtype_from_name
from ..format.format import ManifestError
from ..format.hdf5 import Hdf5Container
from ..format.records import ObjectRecord, ShardedRecord, TensorRecord
from ..reading.stored import RankView, StoredCheckpoint

ExportFormat = Literal["hdf5", "safetensors", "hf"]
Progress = Callable[[int], None]

SAFETENSORS_NATIVE = {
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.complex64,
    torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz,
}  # fmt: skip
_UNSIGNED = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


@dataclass(frozen=True)
class ExportReport:
    step: int
    format: str
    path: Path
    items: int
    bytes: int

    def as_dict(self) -> dict[str, object]:
        return {
            "step": self.step,
            "format": self.format,
            "path": str(self.path),
            "items": self.items,
            "bytes": self.bytes,
        }


@dataclass(frozen=True)
class Selection:
    """What an export writes, from rank 0's view of the checkpoint (``view``): the records by key (sharded
    ones as one whole tensor), the aliases (key -> the key holding its bytes), and the provider prefix
    that the exported names drop."""

    view: RankView
    records: dict[str, TensorRecord | ObjectRecord]
    aliases: dict[str, str]
    prefix: str = ""

    def name(self, key: str) -> str:
        """The name ``key`` is exported under."""
        return key[len(self.prefix) :]


def select(checkpoint: StoredCheckpoint, provider: str | None = None) -> Selection:
    """The items to export: all of them, or those of ``provider`` (keys under ``provider/``).

    An alias whose target lies outside the provider is exported as a tensor of its own."""
    view = checkpoint.view(0)
    prefix = f"{provider}/" if provider else ""
    records: dict[str, TensorRecord | ObjectRecord] = {}
    aliases: dict[str, str] = {}
    for key in view.resolved_keys:
        if not key.startswith(prefix):
            continue
        target = view.stored_key(key)
        if target != key and target.startswith(prefix):
            aliases[key] = target
            continue
        record = view.record(target)
        if isinstance(record, ShardedRecord):
            records[key] = TensorRecord(dtype=record.dtype, shape=record.global_shape, pieces=[])
        elif isinstance(record, (TensorRecord, ObjectRecord)):
            records[key] = record
        else:  # a rank's view resolves per-rank records; anything else is a manifest this code does not know
            raise ManifestError(f"item {key!r}: a {type(record).__name__} cannot be exported")
    return Selection(view, records, aliases, prefix)


@contextmanager
def written_whole(out: Path) -> Iterator[Path]:
    """A temporary path beside ``out`` to write the file to; renamed to ``out`` once the block completes,
    removed if it fails. It is created here, so it gets the usual mode (0666 less the umask) and keeps
    it: safetensors writes a file of mode 0600 and moves it onto the path it is given."""
    temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    os.close(fd)
    try:
        yield temporary
        os.chmod(temporary, mode)
        os.replace(temporary, out)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def export(
    checkpoint: StoredCheckpoint,
    out: Path,
    fmt: ExportFormat,
    progress: Progress | None = None,
    provider: str | None = None,
) -> ExportReport:
    """Write ``checkpoint`` (``provider``'s items only, when given) to the file ``out`` (replacing it) as
    ``fmt``, hdf5 or safetensors (``tiers.ops.hfdir.export_hf`` writes hf directories)."""
    selection = select(checkpoint, provider)
    out.parent.mkdir(parents=True, exist_ok=True)
    with written_whole(out) as path:
        write = _write_hdf5 if fmt == "hdf5" else _write_safetensors
        total = write(path, checkpoint, selection, progress)
    return ExportReport(checkpoint.step, fmt, out, len(selection.records) + len(selection.aliases), total)


def _write_hdf5(path: Path, checkpoint: StoredCheckpoint, selection: Selection, progress: Progress | None) -> int:
    container = Hdf5Container(path, 4096, {"step": checkpoint.step, "created": checkpoint.created}, replace=True)
    total = 0
    try:
        for key, record in selection.records.items():
            if isinstance(record, TensorRecord):
                container.add_tensor(selection.name(key), record.dtype, record.shape, record.shard)
            else:
                container.add_object(selection.name(key), record.serializer, record.length)
        for key, data in selection.view.item_bytes(selection.records):
            write_sliced(container, selection.name(key), data, progress)
            total += data.numel()
        for key, target in selection.aliases.items():
            container.add_alias(selection.name(key), selection.name(target))
        container.finish()
    except BaseException:
        container.close()
        raise
    return total


def _write_safetensors(
    path: Path, checkpoint: StoredCheckpoint, selection: Selection, progress: Progress | None
) -> int:
    tensors: dict[str, torch.Tensor] = {}
    raw: dict[str, dict[str, object]] = {}
    total = 0
    for key, data in selection.view.item_bytes(selection.records):
        name = selection.name(key)
        tensors[name], note = _safetensor(selection.records[key], data)
        if note:
            raw[name] = note
        total += data.numel()
        if progress is not None:
            progress(data.numel())
    rename = selection.name
    objects = {rename(k): r.serializer for k, r in selection.records.items() if isinstance(r, ObjectRecord)}
    aliases = {rename(k): rename(target) for k, target in selection.aliases.items()}
    attrs = {"step": checkpoint.step, "created": checkpoint.created}
    metadata = {f"tierstate.{k}": json.dumps(v) for k, v in attrs.items()}
    metadata |= {"tierstate.objects": json.dumps(objects), "tierstate.raw": json.dumps(raw)}
    metadata["tierstate.aliases"] = json.dumps(aliases)
    save_file(tensors, str(path), metadata=metadata)
    return total


def _safetensor(record: TensorRecord | ObjectRecord, data: torch.Tensor) -> tuple[torch.Tensor, dict[str, object]]:
    """The tensor to store for one record, and (for raw bytes) what it really is."""
    if isinstance(record, ObjectRecord):
        return data, {}
    dtype = dtype_from_name(record.dtype)
    if dtype in SAFETENSORS_NATIVE:
        return data.view(dtype).reshape(record.shape), {}
    unsigned = _UNSIGNED.get(dtype.itemsize)
    note: dict[str, object] = {"dtype": record.dtype, "shape": record.shape}
    if unsigned is None:  # e.g. complex128: bytes per element as the last dimension
        return data.reshape([*record.shape, dtype.itemsize]), note
    return data.view(unsigned).reshape(record.shape), note
