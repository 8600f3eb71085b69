"""tierstate: asynchronous, tiered checkpointing for PyTorch training.

This module is the public API; import from here (``from tierstate import Runner``). The
subpackages ``tierstate.pipeline`` (how bytes move), ``tierstate.providers`` (what state is) and
``tierstate.tiers`` (where bytes live) are the implementation and may change between releases.
"""

from importlib.metadata import PackageNotFoundError, version

from tierstate.errors import TierstateError
from tierstate.pipeline.config import ConfigError, PipelineConfig, load_config
from tierstate.pipeline.distributed import CheckpointAborted
from tierstate.pipeline.handle import CheckpointFailed, CheckpointHandle, CheckpointResult
from tierstate.pipeline.restore import NoCheckpointError, RestoreResult
from tierstate.pipeline.runner import CaptureChangedError, Runner, RunnerClosedError
from tierstate.providers import (
    ChildRestoreError,
    CompositeProvider,
    ModuleProvider,
    ObjectItem,
    ObjectProvider,
    OptimizerProvider,
    RestoreError,
    RNGProvider,
    ShardInfo,
    StatefulProvider,
    StateProvider,
    TensorDictProvider,
    TensorItem,
)
from tierstate.tiers.codecs import CodecError
from tierstate.tiers.commands import UsageError
from tierstate.tiers.dtypes import UnknownDtypeError
from tierstate.tiers.filesystem import CheckpointExistsError, TierError, TierInUseError
from tierstate.tiers.format import ManifestError, MissingItemError, read_manifest
from tierstate.tiers.hdf5 import Hdf5LayoutError
from tierstate.tiers.locks import InUseError
from tierstate.tiers.migrate import MigrateError
from tierstate.tiers.objcodec import ObjectCodecError
from tierstate.tiers.pieces import ReadTooLargeError
from tierstate.tiers.reader import CorruptCheckpointError, load

try:
    __version__ = version("tierstate")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "CaptureChangedError",
    "CheckpointAborted",
    "CheckpointExistsError",
    "CheckpointFailed",
    "CheckpointHandle",
    "CheckpointResult",
    "ChildRestoreError",
    "CodecError",
    "CompositeProvider",
    "ConfigError",
    "CorruptCheckpointError",
    "Hdf5LayoutError",
    "InUseError",
    "ManifestError",
    "MigrateError",
    "MissingItemError",
    "ModuleProvider",
    "NoCheckpointError",
    "ObjectCodecError",
    "ObjectItem",
    "ObjectProvider",
    "OptimizerProvider",
    "PipelineConfig",
    "RNGProvider",
    "ReadTooLargeError",
    "RestoreError",
    "RestoreResult",
    "Runner",
    "RunnerClosedError",
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
    "load",
    "load_config",
    "read_manifest",
]
