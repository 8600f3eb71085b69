"""The one interface of a tier, whatever holds it: what listing, reading, verifying, retention and the
due rule ask of a directory tier (:class:`~tiers.storage.filesystem.FilesystemTier`: local NVMe, a memory tier, a
PFS mount) and of a bucket prefix (:class:`~tiers.storage.s3tier.S3Tier`) alike, as TorchSnapshot's one
``StoragePlugin`` serves every backend.

Code outside the two modules that define them never asks a tier what class it is. Where the two
differ in what they can do (a directory is written by the commit protocol and read through file
descriptors, and is the source of every flush; a bucket takes and gives whole checkpoints by
upload and download), a tier says which it is through ``as_directory()`` and ``as_bucket()``: itself,
typed, or None.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from ..format.manifest import Manifest
from ..reading.source import ByteSource
from .filesystem import FilesystemTier, InvalidEntry, Scope
from .s3tier import S3Tier


@runtime_checkable
class Tier(Protocol):
    """Where committed checkpoints live, each ``step-N`` published by its manifest."""

    @property
    def name(self) -> str: ...

    @property
    def scope(self) -> Scope:
        """``node``: each node its own (NVMe, a memory tier); ``shared``: one every rank sees (PFS, a bucket)."""
        ...

    def where(self, step: int | None = None) -> str:
        """For messages: the tier's location (a directory, an ``s3://`` prefix), or ``step``'s in it."""
        ...

    def steps(self) -> list[int]:
        """Committed steps, ascending (a bucket's: one listing request)."""
        ...

    def holds(self, step: int) -> bool: ...

    def location(self, step: int) -> Path | ByteSource:
        """Where ``step`` is, as :class:`tiers.reading.stored.StoredCheckpoint` takes it."""
        ...

    def manifest(self, step: int) -> Manifest: ...

    def invalid(self) -> list[InvalidEntry]:
        """Entries named like checkpoints that are none (a lost manifest, a symlink), kept for a person."""
        ...

    def delete_step(self, step: int) -> None:
        """Unpublish ``step`` first (it stops being a checkpoint at once), then remove what it held."""
        ...

    def as_directory(self) -> FilesystemTier | None:
        """This tier, if its checkpoints are local directories; else None."""
        ...

    def as_bucket(self) -> S3Tier | None:
        """This tier, if it is a bucket prefix; else None."""
        ...
