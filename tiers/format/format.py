"""Reading and writing the on-disk format: manifest and index bytes, their checks, checksums.

A checkpoint directory holds, per rank, one data file (frames appended at aligned offsets) and an
index (that rank's frames and items, msgpack), and one ``manifest.json`` written last. The manifest
is the only thing a reader trusts, so it is validated strictly: it carries its own checksum, names
files only by their plain names, and every offset, length and dtype is checked before a byte of
data is read. Anything without a valid manifest is not a checkpoint. The records themselves live
in tiers/format/records.py (items, frames, index) and tiers/format/manifest.py (the manifest); this module turns
them into bytes and back.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import msgpack
import xxhash
from pydantic import ValidationError

from tierstate.errors import TierstateError

from ..reading.source import ByteSource, as_source
from ..storage.safeopen import UnsafeFileError
from .dtypes import UnknownDtypeError, dtype_from_name
from .gcpause import gc_paused
from .manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, Manifest, new_checkpoint_id
from .names import data_file_name, data_file_rank, parse_rank_file
from .records import (
    AliasRecord,
    AnyRecord,
    FileRecord,
    IndexRecord,
    ItemRecord,
    PerRankRecord,
    ShardedRecord,
    TensorRecord,
)
from .strict import MAX_BYTES

ZSTD_MAX_RATIO = 1 << 15  # zstd's densest form, a 4-byte RLE block per 128 KiB: no frame expands more


class ManifestError(TierstateError, ValueError):
    """A manifest or index that is missing, corrupt, inconsistent or from a newer format."""


class MissingItemError(TierstateError, KeyError):
    """An item asked for that the checkpoint does not hold (for this rank); the message names it."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""  # KeyError's own would print the message quoted


def checksum(data: bytes | memoryview) -> str:
    """Checksum of one stored frame: xxh3-64, hex. Fast enough to run on every byte we write."""
    return xxhash.xxh3_64_hexdigest(data)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


# --- writing: a manifest in its JSON form -----------------------------------------------------------
#: A manifest as its JSON body (what :func:`manifest_bytes` writes), built directly by the pipeline:
#: a pydantic record costs ~5 us to build and as much again to dump, 0.15 s on the commit path of a
#: checkpoint with 10^4 tensors. :func:`parse_manifest` validates every body when it is read back.
ManifestBody = dict[str, Any]


def piece_body(file: str, frame: int, offset: int, length: int, item_offset: int) -> dict[str, Any]:
    """A :class:`Piece` in its JSON form."""
    return {"file": file, "frame": frame, "offset": offset, "length": length, "item_offset": item_offset}


def tensor_body(
    dtype: str, shape: list[int], pieces: list[dict[str, Any]], shard: tuple[list[int], list[int]] | None = None
) -> dict[str, Any]:
    """A :class:`TensorRecord` in its JSON form; ``shard`` = (global shape, offsets)."""
    placed = None if shard is None else {"global_shape": shard[0], "offsets": shard[1]}
    return {"kind": "tensor", "dtype": dtype, "shape": shape, "shard": placed, "pieces": pieces}


def object_body(serializer: str, length: int, pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """An :class:`ObjectRecord` in its JSON form."""
    return {"kind": "object", "serializer": serializer, "length": length, "pieces": pieces}


def alias_body(of: str) -> dict[str, Any]:
    """An :class:`AliasRecord` in its JSON form."""
    return {"kind": "alias", "of": of}


def manifest_body(step: int, files: dict[str, FileRecord], items: dict[str, dict[str, Any]]) -> ManifestBody:
    """A one-rank manifest's JSON body, of a new checkpoint (its id drawn now): the few top-level fields
    from :class:`Manifest` itself (so defaults cannot drift), the many items as given."""
    body = Manifest(
        step=step, created=now_iso(), files=files, items={}, checkpoint_id=new_checkpoint_id()
    ).model_dump(mode="json")
    body["items"] = items
    return body


@gc_paused()  # the manifest of 10^5 items: see tiers/format/gcpause.py
def manifest_bytes(manifest: Manifest | ManifestBody) -> bytes:
    """JSON with a self-checksum over the canonical body, so an edited manifest is detected."""
    body = manifest.model_dump(mode="json") if isinstance(manifest, Manifest) else manifest
    canonical = _canonical(body)
    # The same bytes as json.dumps({"checksum": ..., "manifest": body}, sort_keys=True) without encoding
    # the body twice. Compact on purpose: with `indent` json falls back to its pure-Python encoder, 4x
    # slower (0.22 s vs 0.06 s for 10^4 items, on the commit path); `tierstate inspect` reads one.
    return b'{"checksum":"' + checksum(canonical).encode() + b'","manifest":' + canonical + b"}"


def _invalid(exc: ValidationError, source: str, what: str) -> ManifestError:
    """The first schema error, at its key path: one precise problem beats a wall of pydantic text."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return ManifestError(f"{source}: invalid {what} at {where}: {first['msg']}")


_HEAD = b'{"checksum":"'
_BODY = b'","manifest":'


def _parse_as_written(raw: bytes) -> Manifest | None:
    """The manifest, if ``raw`` is exactly as :func:`manifest_bytes` writes it and valid; else None.

    The body is then the bytes between the checksum and the last brace, so its checksum is checked
    on those bytes and pydantic validates them as JSON straight into the records: no second encoding
    of the body and no dicts in between (10^5 items: about a third of the parse). Anything else, and
    every invalid manifest, takes the full path below, which says precisely what is wrong.
    """
    start = len(_HEAD) + 16
    if not raw.startswith(_HEAD) or raw[start : start + len(_BODY)] != _BODY or not raw.endswith(b"}"):
        return None
    body = raw[start + len(_BODY) : -1]
    if raw[len(_HEAD) : start] != checksum(body).encode():
        return None
    try:
        manifest = Manifest.model_validate_json(body)
    except ValidationError:
        return None
    return manifest if 1 <= manifest.version <= FORMAT_VERSION else None


@gc_paused()  # 10^5 items are millions of objects: see tiers/format/gcpause.py
def parse_manifest(raw: bytes, source: str) -> Manifest:
    """Parse and fully validate a manifest; every problem is a ManifestError naming ``source``."""
    manifest = _parse_as_written(raw)
    if manifest is not None:
        check_consistency(manifest, source)
        return manifest
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, too-long integers, too-deep nesting
        raise ManifestError(f"{source}: not valid JSON ({type(exc).__name__}: {exc})") from None
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
        raise _invalid(exc, source, "manifest") from None
    check_consistency(manifest, source)
    return manifest


def check_consistency(manifest: Manifest, source: str) -> None:
    """Cross-field checks pydantic cannot express: names, bounds, coverage of every item."""
    for name, record in manifest.files.items():
        if data_file_rank(name) is None:
            raise ManifestError(f"{source}: data file name {name!r} is not allowed (expected rank-NNNNN.data or .h5)")
        end = 0
        # Listed in any order (HDF5 frames are recorded as they finish), but they must not overlap.
        for i, frame in sorted(enumerate(record.frames), key=lambda indexed: indexed[1].offset):
            if frame.offset < end or frame.offset + frame.length > record.size:
                raise ManifestError(f"{source}: file {name} frame {i} overlaps or lies outside the file")
            if frame.codec == "none" and (frame.length != frame.raw_length or frame.shuffle != 1):
                raise ManifestError(f"{source}: file {name} frame {i} is uncompressed but lengths or shuffle differ")
            if frame.codec == "zstd" and frame.raw_length > frame.length * ZSTD_MAX_RATIO:
                raise ManifestError(
                    f"{source}: file {name} frame {i} claims {frame.raw_length} bytes from {frame.length} "
                    "compressed, more than zstd can expand"
                )
            if frame.raw_length % frame.shuffle:
                raise ManifestError(f"{source}: file {name} frame {i}: shuffle width does not divide its length")
            end = frame.offset + frame.length
    for name in manifest.indexes:
        parsed = parse_rank_file(name)
        if parsed is None or parsed.kind != "index":
            raise ManifestError(f"{source}: index file name {name!r} is not allowed")
    for key, item in manifest.items.items():
        try:
            _check_item(manifest, key, item)
        except UnknownDtypeError as exc:
            raise ManifestError(f"{source}: item {key!r}: {exc}") from None
        except ValueError as exc:
            raise ManifestError(f"{source}: item {key!r}: {exc}") from None


def _check_item(manifest: Manifest, key: str, item: AnyRecord) -> None:
    if isinstance(item, ShardedRecord):
        dtype_from_name(item.dtype)
        for shard in item.shards:
            _check_item(manifest, key, shard)
        return
    if isinstance(item, PerRankRecord):
        beyond = [rank for rank in item.ranks if rank >= manifest.world_size]
        if beyond:
            raise ValueError(f"value of rank {beyond[0]}, but world_size is {manifest.world_size}")
        for part in item.ranks.values():
            _check_item(manifest, key, part)
        return
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
    nbytes = manifest.record_nbytes(item)
    covered = 0
    elsewhere = manifest.node_part.ranks if manifest.node_part else None
    pieces = item.pieces if len(item.pieces) < 2 else sorted(item.pieces, key=lambda p: p.item_offset)
    for piece in pieces:
        if piece.item_offset != covered:
            raise ValueError(f"pieces leave a gap or overlap at byte {covered}")
        covered += piece.length
        record = manifest.files.get(piece.file)
        if record is None and elsewhere is not None and data_file_rank(piece.file) not in (None, *elsewhere):
            continue  # in another node's file: that node's part checks it
        if record is None:
            raise ValueError(f"piece in unknown file {piece.file!r}")
        if piece.frame >= len(record.frames):
            raise ValueError(f"piece in frame {piece.frame} of {piece.file}, which has {len(record.frames)}")
        if piece.offset + piece.length > record.frames[piece.frame].raw_length:
            raise ValueError(f"piece overruns frame {piece.frame} of {piece.file}")
    if covered != nbytes:
        raise ValueError(f"pieces cover {covered} bytes, the item has {nbytes}")


def read_manifest(location: Path | ByteSource) -> Manifest:
    """The validated manifest of the checkpoint at ``location`` (a directory or any byte source)."""
    source = as_source(location)
    path = f"{source.where}/{MANIFEST_NAME}"
    try:
        raw = source.read_small(MANIFEST_NAME)
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest (not a committed checkpoint)") from None
    except UnsafeFileError as exc:  # a symlink or FIFO planted under the manifest's name: never read
        raise ManifestError(exc.strerror) from None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read manifest: {exc.strerror}") from None
    return parse_manifest(raw, path)


def index_bytes(rank: int, step: int, file: FileRecord, items: dict[str, dict[str, Any]]) -> bytes:
    """One rank's part of the checkpoint, for multi-rank commit and recovery; ``items`` in JSON form."""
    packed = msgpack.packb({"rank": rank, "step": step, "file": file.model_dump(), "items": items})
    return cast(bytes, packed)  # untyped: None comes only from a Packer(autoreset=False), never from packb


@gc_paused()  # a record per item, as the manifest's: see tiers/format/gcpause.py (here it was 60% of the parse)
def parse_index(raw: bytes, source: str) -> IndexRecord:
    """Parse and fully validate an index; every problem is a ManifestError naming ``source``.

    An index is checked as the one-rank manifest it amounts to, so it gets the very same name,
    bound and coverage checks; its pieces must all lie in this rank's own data file.
    """
    try:
        doc = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ManifestError(f"{source}: not a valid index ({type(exc).__name__}: {exc})") from None
    try:
        index = IndexRecord.model_validate(doc)
    except ValidationError as exc:
        raise _invalid(exc, source, "index") from None
    names = {p.file for record in index.items.values() for p in getattr(record, "pieces", [])}
    own = [n for n in names if data_file_rank(n) == index.rank]
    if len(names) > 1 or len(own) != len(names):
        raise ManifestError(f"{source}: rank {index.rank}'s index has pieces in {sorted(names)}")
    files = {name: index.file for name in names or {data_file_name(index.rank)}}
    items: dict[str, ItemRecord] = dict(index.items)  # every rank record is an item record
    one_rank = Manifest(step=index.step, created="", world_size=index.rank + 1, files=files, items=items)
    check_consistency(one_rank, source)
    return index
