"""Frame codecs: how a chunk's bytes are stored. ``none`` or ``zstd``.

Compression is decided per chunk and skipped when it does not shrink the chunk, so incompressible
data (random-looking fp32 weights) costs one attempt, never extra bytes on disk.
"""

from __future__ import annotations

import threading

import zstandard

_local = threading.local()


class CodecError(ValueError):
    """A frame that cannot be decoded with the codec its manifest names."""


def _compressor(level: int, threads: int) -> zstandard.ZstdCompressor:
    # ZstdCompressor objects are not thread-safe; one per thread and setting is cheap and reused.
    cache = _local.__dict__.setdefault("compressors", {})
    key = (level, threads)
    if key not in cache:
        cache[key] = zstandard.ZstdCompressor(level=level, threads=threads)
    return cache[key]


def compress(raw: bytes | memoryview, level: int, threads: int = 0) -> bytes | None:
    """zstd-compress ``raw``; None when the result would not be smaller (store raw instead)."""
    packed = _compressor(level, threads).compress(raw)
    return packed if len(packed) < len(raw) else None


def decompress(stored: bytes | memoryview, codec: str, raw_length: int) -> bytes | memoryview:
    if codec == "none":
        return stored
    if codec != "zstd":
        raise CodecError(f"unknown codec {codec!r}")
    try:
        raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_length)
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd frame does not decode: {exc}") from None
    if len(raw) != raw_length:
        raise CodecError(f"zstd frame decodes to {len(raw)} bytes, manifest says {raw_length}")
    return raw
