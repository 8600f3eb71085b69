"""PyTorch Distributed Checkpoint (DCP) both ways: ``tierstate export --format dcp`` and ``tierstate import``.

DCP (``torch.distributed.checkpoint``, what TorchTitan writes) stores one nested state dict,
``{"model": {...}, "optim": {...}, ...}``, as a directory with a ``.metadata`` file. Its top-level
names are tierstate's provider names, mapped as :mod:`tierstate.layout` says: a
model's ``state_dict`` as named tensors, an optimizer's (or any ``Stateful``'s) state as its nested
dict, an ``ObjectProvider``'s value as it is.

- **Export**: every item of one checkpoint, read back verified (per-rank items as rank 0's, as the
  other exports do); a tensor sharded over ranks is written as DCP chunks of one global tensor,
  one chunk per shard (offsets and sizes as saved), so ``dcp.load`` on any world size cuts out what
  it needs. The DCP files are written by DCP's own ``FileSystemWriter`` through a save planner that
  adds the chunks; a ``tierstate.json`` beside them records each name's layout, so an import of the
  export gives back the very items. The directory appears whole or not at all.
- **Import**: the whole DCP checkpoint read by DCP's own ``FileSystemReader`` (sharded tensors
  reassembled), then committed through a :class:`~tierstate.Runner` as one step, so it is written,
  checksummed and published like any checkpoint and restores into the usual providers. Objects are
  unpickled with ``weights_only=True`` unless ``allow_pickle``. DCP turns integer dict keys into
  strings; those of a torch optimizer's ``state`` (parameter indices) are turned back into integers.

Both hold the whole state in memory once (DCP's own conversions, ``dcp_to_torch_save``, do the same).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from tierstate import ExportReport, ObjectCodecError, Serializer, TierstateError, layout

from ..tiers.reading.stored import StoredCheckpoint
from .dcp_metadata import ForbiddenGlobalError, restricted_reader

LAYOUT_FILE = "tierstate.json"
"""Written beside the DCP files of an export: the step and each name's layout (DCP readers ignore it)."""

Progress = Callable[[int], None]

ROOT_NAME = "model"
"""Where an import puts tensors found at the top level of a DCP checkpoint (TorchTitan's model)."""


class DcpError(TierstateError, ValueError):
    """A DCP checkpoint that cannot be brought in or written as asked (the name or key is given)."""


@contextmanager
def _unwrapped(what: str) -> Iterator[None]:
    """The error DCP met instead of DCP's ``CheckpointException`` (a BaseException: it would pass every
    ``except Exception``): tierstate's and OSErrors as they are, anything else as a DcpError saying ``what``."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        errors = [error for error, _trace in exc.failures.values()]
        first = errors[0] if errors else exc
        if isinstance(first, (TierstateError, OSError)):
            raise first from None
        raise DcpError(f"{what} failed: {first!r}") from None


# --- export -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Shards:
    """A tensor sharded over ranks: its shards (offsets -> tensor) become DCP chunks of one global tensor."""

    global_shape: tuple[int, ...]
    parts: dict[tuple[int, ...], torch.Tensor]


def _logical_state(checkpoint: StoredCheckpoint, progress: Progress | None) -> tuple[dict[str, Any], int]:
    """Every item as rank 0 reads it, sharded tensors as :class:`_Shards`; and the bytes read."""
    view = checkpoint.view(0)
    sharded = {key for key in view.keys if view.stored_key(key) == key and view.is_sharded(key)}
    plain = [key for key in view.keys if view.stored_key(key) not in sharded]
    values: dict[str, Any] = view.read(plain)
    total = sum(v.nbytes for v in values.values() if isinstance(v, torch.Tensor))
    for key in sorted(sharded):
        boxes = view.shard_boxes(key)
        parts = view.read_regions([view.region(key, box) for box in boxes]).tensors
        values[key] = _Shards(view.global_shape(key), dict(zip((b.offsets for b in boxes), parts, strict=True)))
        total += sum(part.nbytes for part in parts)
    for key in view.keys:  # aliases of sharded tensors: the same placeholder
        target = view.stored_key(key)
        if target != key and target in sharded:
            values[key] = values[target]
    if progress is not None:
        progress(total)
    return values, total


def _shard_planner() -> Any:
    """A DCP save planner that writes each :class:`_Shards` as chunks of one global tensor (one per shard)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_local_save_plan
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    class ShardSavePlanner(DefaultSavePlanner):
        def create_local_plan(self) -> Any:
            shards = {fqn: v for fqn, v in self.state_dict.items() if isinstance(v, _Shards)}
            rest = {fqn: v for fqn, v in self.state_dict.items() if fqn not in shards}
            for fqn, value in rest.items():
                if isinstance(value, (list, tuple)) and any(isinstance(v, _Shards) for v in value):
                    raise DcpError(f"{fqn}: a sharded tensor inside a list cannot be written as DCP chunks")
            plan = create_default_local_save_plan(rest, self.is_coordinator)
            items = list(plan.items)
            for fqn, value in shards.items():
                for offsets, part in value.parts.items():
                    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=part.shape)
                    properties = TensorProperties.create_from_tensor(part)
                    data = TensorWriteData(chunk, properties, torch.Size(value.global_shape))
                    index = MetadataIndex(fqn, torch.Size(offsets))
                    items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
            self.plan = dataclasses.replace(plan, items=items, planner_data=self.mappings)
            return self.plan

        def lookup_object(self, index: Any) -> Any:
            value = self.state_dict[index.fqn]
            if isinstance(value, _Shards):
                return value.parts[tuple(index.offset)]
            return super().lookup_object(index)

    return ShardSavePlanner()


@contextmanager
def _directory_written_whole(out: Path) -> Iterator[Path]:
    """A fresh directory beside ``out`` to write into; it takes ``out``'s place (replacing an existing
    one) once the block completes, and is removed if it fails."""
    temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    try:
        yield temporary
        if out.is_dir() and not out.is_symlink():
            old = out.with_name(f".{out.name}.{os.getpid()}.old")
            os.replace(out, old)
            os.replace(temporary, out)
            shutil.rmtree(old)
        else:
            if out.exists() or out.is_symlink():
                out.unlink()
            os.replace(temporary, out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def export_dcp(checkpoint: StoredCheckpoint, out: Path, progress: Progress | None = None) -> ExportReport:
    """Write ``checkpoint`` as the DCP checkpoint directory ``out`` (replacing it)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    values, total = _logical_state(checkpoint, progress)
    state: dict[str, Any] = {}
    layouts: dict[str, layout.Layout] = {}
    for name, items in layout.group_by_name(values).items():
        state[name], layouts[name] = layout.rebuild(items)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _directory_written_whole(out) as path:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            with _unwrapped(f"{out}: DCP save"):
                save(state, storage_writer=FileSystemWriter(path), planner=_shard_planner(), no_dist=True)
        (path / LAYOUT_FILE).write_text(json.dumps({"step": checkpoint.step, "layout": layouts}, indent=1) + "\n")
    return ExportReport(checkpoint.step, "dcp", out, len(checkpoint.keys), total)


# --- import -------------------------------------------------------------------------------------
def _whole_load_planner(allow_pickle: bool) -> Any:
    """DCP's planner that rebuilds the whole state dict from the metadata (as ``dcp_to_torch_save`` does),
    unpickling objects with ``weights_only`` unless ``allow_pickle``."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    class WholeLoadPlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                loaded = torch.load(value, weights_only=not allow_pickle)
            except Exception as exc:  # weights_only refuses what it does not know
                if allow_pickle:
                    raise DcpError(f"DCP object {fqn!r} cannot be loaded: {exc!r}") from None
                raise DcpError(
                    f"DCP object {fqn!r} needs pickle to load (weights_only refuses it); "
                    "allow it for a checkpoint you trust (--allow-pickle)"
                ) from None
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return WholeLoadPlanner()


def _optimizer_indices(value: Any) -> Any:
    """``value`` with every torch optimizer state dict's ``state`` keyed by int again (DCP made them strings)."""
    if isinstance(value, list):
        return [_optimizer_indices(v) for v in value]
    if not isinstance(value, dict):
        return value
    value = {k: _optimizer_indices(v) for k, v in value.items()}
    state, groups = value.get("state"), value.get("param_groups")
    if isinstance(state, dict) and isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
        params = [p for g in groups for p in g.get("params", [])]
        indices = all(isinstance(k, str) and k.isdigit() for k in state)
        if params and indices and all(isinstance(p, int) for p in params):
            value["state"] = {int(k): v for k, v in state.items()}
    return value


def read_dcp(
    source: Path, allow_pickle: bool = False, root_name: str = ROOT_NAME
) -> tuple[dict[str, Any], dict[str, layout.Layout]]:
    """The whole state of the DCP checkpoint ``source`` (nested as saved) and each top-level name's layout:
    as recorded by a tierstate export, else as :func:`~tierstate.layout.layout_of` tells.

    Tensors at the top level (TorchTitan saves the model's state dict there, beside ``optimizer``,
    ``lr_scheduler``, ``dataloader`` and ``train_state``) are gathered under ``root_name``."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load

    if not (source / ".metadata").is_file():
        raise DcpError(f"{source}: not a DCP checkpoint (no .metadata file)")
    reader = FileSystemReader(source) if allow_pickle else _restricted_reader(source)
    planner = _whole_load_planner(allow_pickle)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        with _unwrapped(f"{source}: DCP load"):
            load({}, storage_reader=reader, planner=planner, no_dist=True)
    state = _gather_root_tensors(
        {str(k): _optimizer_indices(v) for k, v in planner.original_state_dict.items()}, root_name, source
    )
    recorded = _recorded_layouts(source)
    layouts: dict[str, layout.Layout] = {
        name: recorded.get(name) or layout.layout_of(value) for name, value in state.items()
    }
    return state, layouts


def _restricted_reader(source: Path) -> Any:
    """DCP's reader over ``source`` with its ``.metadata`` read by the restricted unpickler, or a
    DcpError naming the file and what it asked for (a forged one would run code under plain pickle)."""
    try:
        return restricted_reader(source)
    except ForbiddenGlobalError as exc:
        raise DcpError(
            f"{source / '.metadata'}: refused: it names {exc}, which DCP's metadata never holds "
            "(unpickling it would run code); import a checkpoint you trust with --allow-pickle"
        ) from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError) as exc:
        raise DcpError(f"{source / '.metadata'}: not DCP metadata ({exc})") from None


def _gather_root_tensors(state: dict[str, Any], root_name: str, source: Path) -> dict[str, Any]:
    roots = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    if not roots:
        return state
    if root_name in state:
        raise DcpError(f"{source}: tensors at the top level ({next(iter(roots))!r}, ...) and a {root_name!r} entry")
    return {root_name: roots, **{k: v for k, v in state.items() if k not in roots}}


def _recorded_layouts(source: Path) -> dict[str, layout.Layout]:
    path = source / LAYOUT_FILE
    if not path.is_file():
        return {}
    try:
        layouts = json.loads(path.read_text())["layout"]
    except (ValueError, KeyError, TypeError) as exc:
        raise DcpError(f"{path}: not a tierstate layout file: {exc!r}") from None
    if not isinstance(layouts, dict) or any(v not in layout.LAYOUTS for v in layouts.values()):
        raise DcpError(f"{path}: layouts must map names to one of {', '.join(layout.LAYOUTS)}")
    return cast(dict[str, layout.Layout], layouts)


def _serializer(name: str, value: Any, laid_out: layout.Layout, allow_pickle: bool) -> Serializer:
    """How the objects of ``value`` are stored (see ``serializer_for``); DcpError naming what msgpack refuses."""
    try:
        return layout.serializer_for(layout.describe(value, laid_out), allow_pickle)
    except ObjectCodecError as exc:
        raise DcpError(f"DCP state {name!r}, {exc}") from None


@dataclass(frozen=True)
class ImportReport:
    step: int
    tier: str
    path: Path | str  # the checkpoint's directory, or its s3:// prefix when imported into a bucket
    names: dict[str, layout.Layout]
    items: int
    bytes: int

    def as_dict(self) -> dict[str, object]:
        fields = {"step": self.step, "tier": self.tier, "path": str(self.path), "names": self.names}
        return {**fields, "items": self.items, "bytes": self.bytes}


def import_dcp(
    source: Path,
    tier: str,
    root: Path,
    step: int,
    allow_pickle: bool = False,
    layouts: Mapping[str, layout.Layout] | None = None,
    root_name: str = ROOT_NAME,
) -> ImportReport:
    """Commit the DCP checkpoint ``source`` as checkpoint ``step`` on the tier ``tier`` (directory ``root``).

    Each top-level name becomes a provider of that name; ``layouts`` overrides how a name is laid out.
    """
    from tierstate import Runner

    state, found = read_dcp(source, allow_pickle, root_name)
    bad = [name for name in state if not name or "/" in name]
    if bad:
        raise DcpError(f"{source}: top-level name {bad[0]!r} cannot name a provider (empty, or contains '/')")
    chosen: dict[str, layout.Layout] = {**found, **(layouts or {})}
    providers = {
        name: layout.ValueProvider(
            lambda v=value: v, chosen[name], _serializer(name, value, chosen[name], allow_pickle)
        )
        for name, value in state.items()
    }
    config = {"tiers": {tier: {"path": str(root)}}, "policies": {"allow_pickle": allow_pickle}}
    with Runner.from_dict(config, distributed=False) as runner:
        runner.register(**providers)
        result = runner.checkpoint(step).result()
    manifest_items = sum(len(p.describe()) for p in providers.values())
    return ImportReport(step, tier, result.path, chosen, manifest_items, result.raw_bytes)
