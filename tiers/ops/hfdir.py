"""``tierstate export STEP DIR --format hf --provider model``: a Hugging Face model directory.

``from_pretrained(DIR)`` reads the weights of a model from ``model.safetensors``, or from shards
``model-00001-of-0000N.safetensors`` listed in ``model.safetensors.index.json`` (``weight_map``: tensor
name -> shard file; ``metadata.total_size``: bytes). It wants the model's own ``state_dict`` names and
nothing else in those files, so the export takes one provider's items, names them without the
provider's prefix and leaves out every other provider (optimizer, RNG, trainer state).

As ``save_pretrained`` does, tied weights are stored once, under the first of their names in
``state_dict`` order (the input embedding of a causal LM: ``from_pretrained`` ties the output layer to
it); shards are filled in key order up to ``max_shard_size`` (a larger tensor gets a shard of its own);
each file carries the metadata ``{"format": "pt"}`` that ``from_pretrained`` checks. ``config.json``
(and a tokenizer) are the user's to put beside the weights: a checkpoint holds values, not the model's
architecture.

Each file is written whole under a temporary name and renamed; the index last, so a reader never
finds it naming a shard that is not there. Weight files of an earlier export that this one does not
write are removed, as ``save_pretrained`` removes stale shards, so the directory never mixes two exports.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from tierstate.errors import TierstateError

from ..format.dtypes import dtype_from_name
from ..format.records import ObjectRecord, TensorRecord
from ..reading.stored import RankView, StoredCheckpoint
from .export import SAFETENSORS_NATIVE, ExportReport, Progress, Selection, select, written_whole

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
MAX_SHARD_SIZE = 50 * 10**9
"""``save_pretrained``'s default ``max_shard_size`` ("50GB") in transformers 5 (4.x used "5GB")."""


class HfExportError(TierstateError, ValueError):
    """The selected items cannot form a Hugging Face weights file (objects, types safetensors lacks)."""


def weight_files(directory: Path) -> list[Path]:
    """The weight files of an exported model in ``directory`` (the single file, shards, the index)."""
    if not directory.is_dir():
        return []
    names = sorted(p.name for p in directory.iterdir())
    return [directory / n for n in names if n in (WEIGHTS_NAME, INDEX_NAME) or SHARD_PATTERN.fullmatch(n)]


def plan_shards(sizes: dict[str, int], max_shard_size: int) -> list[list[str]]:
    """Keys in order, cut into consecutive shards of at most ``max_shard_size`` bytes (a larger key alone)."""
    shards: list[list[str]] = []
    current: list[str] = []
    filled = 0
    for key, size in sizes.items():
        if current and filled + size > max_shard_size:
            shards.append(current)
            current, filled = [], 0
        current.append(key)
        filled += size
    return [*shards, current] if current else shards


def _shard_names(count: int) -> list[str]:
    if count <= 1:
        return [WEIGHTS_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _refuse_what_hf_cannot_hold(selection: Selection) -> None:
    records = selection.records
    objects = [selection.name(key) for key, record in records.items() if isinstance(record, ObjectRecord)]
    if objects:
        raise HfExportError(
            f"provider {selection.prefix.rstrip('/')!r} holds objects ({', '.join(objects[:4])}): "
            "a Hugging Face weights file holds tensors only"
        )
    foreign = [
        f"{selection.name(key)} ({record.dtype})"
        for key, record in records.items()
        if isinstance(record, TensorRecord) and dtype_from_name(record.dtype) not in SAFETENSORS_NATIVE
    ]
    if foreign:
        raise HfExportError(f"safetensors has no type for {', '.join(foreign[:4])}")


def export_hf(
    checkpoint: StoredCheckpoint,
    out: Path,
    provider: str,
    progress: Progress | None = None,
    max_shard_size: int = MAX_SHARD_SIZE,
) -> ExportReport:
    """Write ``provider``'s tensors of ``checkpoint`` as the weights of the model directory ``out``."""
    selection = select(checkpoint, provider)
    records = selection.records
    _refuse_what_hf_cannot_hold(selection)
    tensor_records = {key: record for key, record in records.items() if isinstance(record, TensorRecord)}
    sizes = {key: _nbytes(record) for key, record in tensor_records.items()}
    shards = plan_shards(sizes, max_shard_size)
    names = _shard_names(len(shards))
    stale = set(weight_files(out)) - {out / name for name in names}
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for keys, name in zip(shards, names, strict=True):
        tensors = dict(_tensors(selection.view, {k: tensor_records[k] for k in keys}, progress))
        with written_whole(out / name) as path:
            save_file({selection.name(k): t for k, t in tensors.items()}, str(path), metadata={"format": "pt"})
        weight_map |= {selection.name(k): name for k in keys}
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
        with written_whole(out / INDEX_NAME) as path:
            path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    for path in stale:
        path.unlink(missing_ok=True)
    return ExportReport(checkpoint.step, "hf", out, len(records), sum(sizes.values()))


def _nbytes(record: TensorRecord) -> int:
    """The tensor's bytes, from its dtype and (global) shape: a sharded one's record has no pieces of its own."""
    return math.prod(record.shape) * dtype_from_name(record.dtype).itemsize


def _tensors(
    view: RankView, records: dict[str, TensorRecord], progress: Progress | None
) -> Iterator[tuple[str, torch.Tensor]]:
    for key, data in view.item_bytes(records):
        record = records[key]
        if progress is not None:
            progress(data.numel())
        yield key, data.view(dtype_from_name(record.dtype)).reshape(record.shape)
