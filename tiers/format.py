"""The on-disk format: manifest, per-rank index, frame records, checksums.

A checkpoint directory holds, per rank, one data file (frames appended at aligned offsets) and an
index (that rank's frames and items, msgpack), and one ``manifest.json`` written last. The manifest
is the only thing a reader trusts, so it is validated strictly: it carries its own checksum, names
files only by their plain names, and every offset, length and dtype is checked before a byte of
data is read. Anything without a valid manifest is not a checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import msgpack
import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tiers.dtypes import UnknownDtypeError, dtype_from_name

FORMAT_NAME = "tierstate"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
CODECS = ("none", "zstd")
MAX_BYTES = 1 << 50  # far beyond any real checkpoint; rejects absurd sizes before allocation
DATA_FILE_RE = re.compile(r"^rank-\d{5}\.data$")

NonNegative = Annotated[int, Field(ge=0, le=MAX_BYTES)]


class ManifestError(ValueError):
    """A manifest or index that is missing, corrupt, inconsistent or from a newer format."""


def checksum(data: bytes | memoryview) -> str:
    """Checksum of one stored frame: xxh3-64, hex. Fast enough to run on every byte we write."""
    return xxhash.xxh3_64_hexdigest(data)


def data_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.data"


def index_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.index"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FrameRecord(_Strict):
    """One chunk as stored: where it is in its data file, how it is encoded, its checksum."""

    offset: NonNegative
    length: NonNegative
    raw_length: NonNegative
    codec: Literal["none", "zstd"]
    shuffle: Literal[1, 2, 4, 8, 16] = 1
    checksum: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]


class FileRecord(_Strict):
    size: NonNegative
    frames: list[FrameRecord]


class Piece(_Strict):
    """A byte range of one item inside one frame's decoded bytes."""

    file: str
    frame: NonNegative
    offset: NonNegative
    length: NonNegative
    item_offset: NonNegative


class ShardRecord(_Strict):
    global_shape: list[NonNegative]
    offsets: list[NonNegative]


class TensorRecord(_Strict):
    kind: Literal["tensor"] = "tensor"
    dtype: str
    shape: list[NonNegative]
    shard: ShardRecord | None = None
    pieces: list[Piece]


class ObjectRecord(_Strict):
    kind: Literal["object"] = "object"
    serializer: Literal["json", "msgpack", "pickle"]
    length: NonNegative
    pieces: list[Piece]


class AliasRecord(_Strict):
    """An item that is the very same tensor as another (tied weights): stored once."""

    kind: Literal["alias"] = "alias"
    of: str


ItemRecord = Annotated[TensorRecord | ObjectRecord | AliasRecord, Field(discriminator="kind")]


class Manifest(_Strict):
    format: Literal["tierstate"] = FORMAT_NAME
    version: int = FORMAT_VERSION
    step: NonNegative
    created: str
    world_size: Annotated[int, Field(ge=1, le=1 << 20)] = 1
    files: dict[str, FileRecord]
    indexes: dict[str, str] = {}
    items: dict[str, ItemRecord]

    def item_nbytes(self, key: str) -> int:
        record = self.items[key]
        if isinstance(record, AliasRecord):
            return self.item_nbytes(record.of)
        if isinstance(record, ObjectRecord):
            return record.length
        return math.prod(record.shape) * dtype_from_name(record.dtype).itemsize

    @property
    def stored_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def raw_bytes(self) -> int:
        return sum(fr.raw_length for f in self.files.values() for fr in f.frames)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def manifest_bytes(manifest: Manifest) -> bytes:
    """JSON with a self-checksum over the canonical body, so an edited manifest is detected."""
    body = manifest.model_dump(mode="json")
    doc = {"manifest": body, "checksum": checksum(_canonical(body))}
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def parse_manifest(raw: bytes, source: str) -> Manifest:
    """Parse and fully validate a manifest; every problem is a ManifestError naming ``source``."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{source}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or set(doc) != {"manifest", "checksum"} or not isinstance(doc["manifest"], dict):
        raise ManifestError(f"{source}: not a tierstate manifest (expected keys 'manifest' and 'checksum')")
    body = doc["manifest"]
    if body.get("format") != FORMAT_NAME:
        raise ManifestError(f"{source}: format is {body.get('format')!r}, expected {FORMAT_NAME!r}")
    version = body.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ManifestError(f"{source}: invalid format version {version!r}")
    if version > FORMAT_VERSION:
        raise ManifestError(
            f"{source}: written by a newer tierstate (format version {version}; this one reads up to {FORMAT_VERSION})"
        )
    if doc["checksum"] != checksum(_canonical(body)):
        raise ManifestError(f"{source}: manifest checksum mismatch (the file was edited or corrupted)")
    try:
        manifest = Manifest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ManifestError(f"{source}: invalid manifest at {where}: {first['msg']}") from None
    check_consistency(manifest, source)
    return manifest


def check_consistency(manifest: Manifest, source: str) -> None:
    """Cross-field checks pydantic cannot express: names, bounds, coverage of every item."""
    for name, record in manifest.files.items():
        if not DATA_FILE_RE.match(name):
            raise ManifestError(f"{source}: data file name {name!r} is not allowed (expected rank-NNNNN.data)")
        end = 0
        for i, frame in enumerate(record.frames):
            if frame.offset < end or frame.offset + frame.length > record.size:
                raise ManifestError(f"{source}: file {name} frame {i} overlaps or lies outside the file")
            if frame.codec == "none" and (frame.length != frame.raw_length or frame.shuffle != 1):
                raise ManifestError(f"{source}: file {name} frame {i} is uncompressed but lengths or shuffle differ")
            if frame.raw_length % frame.shuffle:
                raise ManifestError(f"{source}: file {name} frame {i}: shuffle width does not divide its length")
            end = frame.offset + frame.length
    for name in manifest.indexes:
        if not re.match(r"^rank-\d{5}\.index$", name):
            raise ManifestError(f"{source}: index file name {name!r} is not allowed")
    for key, item in manifest.items.items():
        try:
            _check_item(manifest, key, item)
        except UnknownDtypeError as exc:
            raise ManifestError(f"{source}: item {key!r}: {exc}") from None
        except ValueError as exc:
            raise ManifestError(f"{source}: item {key!r}: {exc}") from None


def _check_item(manifest: Manifest, key: str, item: TensorRecord | ObjectRecord | AliasRecord) -> None:
    if isinstance(item, AliasRecord):
        target = manifest.items.get(item.of)
        if target is None or isinstance(target, AliasRecord):
            raise ValueError(f"alias of {item.of!r}, which is not a stored item")
        return
    if isinstance(item, TensorRecord):
        dtype = dtype_from_name(item.dtype)
        if item.shard is not None and len(item.shard.global_shape) != len(item.shard.offsets):
            raise ValueError("shard global_shape and offsets differ in rank")
        if math.prod(item.shape) * dtype.itemsize > MAX_BYTES:
            raise ValueError(f"absurd shape {item.shape}")
    nbytes = manifest.item_nbytes(key)
    covered = 0
    for piece in sorted(item.pieces, key=lambda p: p.item_offset):
        record = manifest.files.get(piece.file)
        if record is None:
            raise ValueError(f"piece in unknown file {piece.file!r}")
        if piece.frame >= len(record.frames):
            raise ValueError(f"piece in frame {piece.frame} of {piece.file}, which has {len(record.frames)}")
        if piece.offset + piece.length > record.frames[piece.frame].raw_length:
            raise ValueError(f"piece overruns frame {piece.frame} of {piece.file}")
        if piece.item_offset != covered:
            raise ValueError(f"pieces leave a gap or overlap at byte {covered}")
        covered += piece.length
    if covered != nbytes:
        raise ValueError(f"pieces cover {covered} bytes, the item has {nbytes}")


def read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest (not a committed checkpoint)") from None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read manifest: {exc.strerror}") from None
    return parse_manifest(raw, str(path))


def write_durably(path: Path, data: bytes) -> None:
    """Write via a temporary name, fsync, then rename: a reader sees the whole file or none."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def index_bytes(rank: int, step: int, file: FileRecord, items: dict[str, Any]) -> bytes:
    """One rank's part of the checkpoint, for multi-rank commit and recovery."""
    return msgpack.packb(
        {"rank": rank, "step": step, "file": file.model_dump(), "items": {k: v.model_dump() for k, v in items.items()}}
    )
