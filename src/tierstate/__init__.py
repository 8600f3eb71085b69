"""tierstate: asynchronous, tiered checkpointing for PyTorch training.

This module is the public API; import from here (``from tierstate import Runner``). The
subpackages ``tierstate.pipeline`` (how bytes move), ``tierstate.providers`` (what state is) and
``tierstate.tiers`` (where bytes live) are the implementation and may change between releases.

The names are imported on first use (PEP 562): importing torch takes seconds, and the ``tierstate``
command, which runs this module first, must answer ``--help`` and ``--version`` without it.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from tierstate._version import __version__
from tierstate.errors import TierstateError

if TYPE_CHECKING:  # what type checkers and editors see; _HOMES tells the interpreter the same
    from tierstate.errors import UsageError
    from tierstate.pipeline.buckets import open_buckets
    from tierstate.pipeline.config import ConfigError, PipelineConfig, load_config, parse_config
    from tierstate.pipeline.distributed import CheckpointAborted
    from tierstate.pipeline.fresh import ExistingCheckpointsError
    from tierstate.pipeline.handle import CheckpointFailed, CheckpointHandle, CheckpointResult
    from tierstate.pipeline.laziness import AttachError
    from tierstate.pipeline.lifecycle import RunnerClosedError
    from tierstate.pipeline.metrics import CheckpointStats, RunMetrics
    from tierstate.pipeline.registration import RegistrationError
    from tierstate.pipeline.request import CaptureChangedError, InvalidStepError, NothingRegisteredError
    from tierstate.pipeline.restore import NoCheckpointError, NothingToRestoreError, RestoreResult
    from tierstate.pipeline.runner import Runner
    from tierstate.providers import (
        ChildRestoreError,
        CompositeProvider,
        MetaBufferError,
        ModuleProvider,
        ObjectItem,
        ObjectProvider,
        OptimizerProvider,
        ProviderNameError,
        RestoreError,
        RNGProvider,
        ShardInfo,
        StatefulProvider,
        StateProvider,
        TensorDictProvider,
        TensorItem,
        empty_init,
        materialize,
    )
    from tierstate.providers import layout as layout
    from tierstate.providers.dtensor import storage_of
    from tierstate.providers.items import Item, Serializer
    from tierstate.tiers.format.codecs import CodecError
    from tierstate.tiers.format.dtypes import UnknownDtypeError
    from tierstate.tiers.format.format import ManifestError, MissingItemError, read_manifest
    from tierstate.tiers.format.hdf5 import Hdf5LayoutError
    from tierstate.tiers.format.objcodec import ObjectCodecError
    from tierstate.tiers.ops.export import ExportReport
    from tierstate.tiers.ops.migrate import MigrateError
    from tierstate.tiers.reading.pieces import ReadTooLargeError
    from tierstate.tiers.reading.stored import CorruptCheckpointError, load
    from tierstate.tiers.storage.filesystem import CheckpointExistsError, FilesystemTier, TierError, TierInUseError
    from tierstate.tiers.storage.locks import InUseError

# Where the public names live: imported from there on first use.
_HOMES = {
    "tierstate.pipeline.buckets": ("open_buckets",),
    "tierstate.pipeline.config": ("ConfigError", "PipelineConfig", "load_config", "parse_config"),
    "tierstate.pipeline.distributed": ("CheckpointAborted",),
    "tierstate.pipeline.fresh": ("ExistingCheckpointsError",),
    "tierstate.pipeline.handle": ("CheckpointFailed", "CheckpointHandle", "CheckpointResult"),
    "tierstate.errors": ("UsageError",),
    "tierstate.pipeline.laziness": ("AttachError",),
    "tierstate.pipeline.lifecycle": ("RunnerClosedError",),
    "tierstate.pipeline.metrics": ("CheckpointStats", "RunMetrics"),
    "tierstate.pipeline.registration": ("RegistrationError",),
    "tierstate.pipeline.restore": ("NoCheckpointError", "NothingToRestoreError", "RestoreResult"),
    "tierstate.pipeline.request": ("CaptureChangedError", "InvalidStepError", "NothingRegisteredError"),
    "tierstate.pipeline.runner": ("Runner",),
    "tierstate.providers": (
        "ChildRestoreError", "CompositeProvider", "MetaBufferError", "ModuleProvider", "ObjectItem", "ObjectProvider",
        "OptimizerProvider", "ProviderNameError", "RestoreError", "RNGProvider", "ShardInfo", "StatefulProvider",
        "StateProvider",
        "TensorDictProvider", "TensorItem", "empty_init", "materialize",
    ),
    "tierstate.providers.dtensor": ("storage_of",),
    "tierstate.providers.items": ("Item", "Serializer"),
    "tierstate.tiers.format.codecs": ("CodecError",),
    "tierstate.tiers.format.dtypes": ("UnknownDtypeError",),
    "tierstate.tiers.ops.export": ("ExportReport",),
    "tierstate.tiers.storage.filesystem": ("CheckpointExistsError", "FilesystemTier", "TierError", "TierInUseError"),
    "tierstate.tiers.format.format": ("ManifestError", "MissingItemError", "read_manifest"),
    "tierstate.tiers.format.hdf5": ("Hdf5LayoutError",),
    "tierstate.tiers.storage.locks": ("InUseError",),
    "tierstate.tiers.ops.migrate": ("MigrateError",),
    "tierstate.tiers.format.objcodec": ("ObjectCodecError",),
    "tierstate.tiers.reading.pieces": ("ReadTooLargeError",),
    "tierstate.tiers.reading.stored": ("CorruptCheckpointError", "load"),
}  # fmt: skip
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}
# Public modules, imported on first use too: ``tierstate.layout`` (how a framework's nested state maps to
# items, for integrations such as Lightning's and DCP's) lives in providers, which knows the items' keys.
_MODULES = {"layout": "tierstate.providers.layout"}



def __getattr__(name: str) -> Any:
    """Import a public name's module on first use, then keep the name here."""
    if name in _MODULES:
        value: Any = import_module(_MODULES[name])
    elif name in _HOME_OF:
        value = getattr(import_module(_HOME_OF[name]), name)
    else:
        raise AttributeError(f"module 'tierstate' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME_OF, *_MODULES})


__all__ = [
    "AttachError",
    "CaptureChangedError",
    "CheckpointAborted",
    "CheckpointExistsError",
    "CheckpointFailed",
    "CheckpointHandle",
    "CheckpointResult",
    "CheckpointStats",
    "ChildRestoreError",
    "CodecError",
    "CompositeProvider",
    "ConfigError",
    "CorruptCheckpointError",
    "ExistingCheckpointsError",
    "ExportReport",
    "FilesystemTier",
    "Hdf5LayoutError",
    "InUseError",
    "InvalidStepError",
    "Item",
    "ManifestError",
    "MetaBufferError",
    "MigrateError",
    "MissingItemError",
    "ModuleProvider",
    "NoCheckpointError",
    "NothingRegisteredError",
    "NothingToRestoreError",
    "ObjectCodecError",
    "ObjectItem",
    "ObjectProvider",
    "OptimizerProvider",
    "PipelineConfig",
    "ProviderNameError",
    "RNGProvider",
    "ReadTooLargeError",
    "RegistrationError",
    "RestoreError",
    "RestoreResult",
    "RunMetrics",
    "Runner",
    "RunnerClosedError",
    "Serializer",
    "ShardInfo",
    "StateProvider",
    "StatefulProvider",
    "TensorDictProvider",
    "TensorItem",
    "TierError",
    "TierInUseError",
    "TierstateError",
    "UnknownDtypeError",
    "UsageError",
    "__version__",
    "empty_init",
    "layout",
    "load",
    "load_config",
    "materialize",
    "open_buckets",
    "parse_config",
    "read_manifest",
    "storage_of",
]
