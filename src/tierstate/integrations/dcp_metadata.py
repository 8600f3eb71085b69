"""DCP's ``.metadata`` read without running code from the file.

torch's ``FileSystemReader.read_metadata`` is a plain ``pickle.load``: a forged ``.metadata`` runs
any callable it names (``os.system``) before a byte of the checkpoint is looked at. Here the
unpickler admits only what DCP's own metadata is built of (its dataclasses and enums, the storage
info of the file system writer, ``torch.Size``, dtypes, layouts, paths) and refuses anything else,
naming the global; a user who trusts the file may still ask for plain pickle (``--allow-pickle``).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

from tierstate.errors import TierstateError

# module -> names DCP's metadata pickles refer to (as written by torch.distributed.checkpoint's
# save in torch 2.5-2.13); constructing any of them runs no code of the file's choosing.
_ADMITTED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
            "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
    "torch": frozenset({"Size"}),
}


class ForbiddenGlobalError(TierstateError, pickle.UnpicklingError):
    """A ``.metadata`` names a global that DCP's metadata never holds (it would run code)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes and torch dtypes; anything else is a :class:`ForbiddenGlobalError`."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ADMITTED.get(module, ()):
            return super().find_class(module, name)
        raise ForbiddenGlobalError(f"{module}.{name}")


def load_metadata(path: Path) -> Any:
    """The DCP ``Metadata`` in ``path``, unpickled with only DCP's own classes admitted."""
    return _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()


def restricted_reader(source: Path) -> Any:
    """A ``FileSystemReader`` over ``source`` that hands DCP the metadata :func:`load_metadata` read,
    once, here: a refused file fails before DCP's load starts (no traceback logged by DCP)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    metadata = load_metadata(source / ".metadata")
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not a DCP Metadata")

    class RestrictedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ARG002 (DCP passes rank=)
            storage = metadata.storage_meta or StorageMeta()  # as torch's own read_metadata fills it
            storage.load_id = self.load_id
            metadata.storage_meta = storage
            return metadata

    return RestrictedReader(source)
