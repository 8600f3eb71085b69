"""Frame codecs: how a chunk's bytes are stored. ``none``, or ``zstd`` after an optional byte shuffle.

Float weights compress poorly as they are: each value's sign/exponent byte sits next to its noisy
mantissa bytes. Splitting the bytes of each element into planes (all first bytes, then all
second bytes, ...) puts the low-entropy exponent bytes together, which is where zstd wins on bf16,
fp16 and fp32. The shuffle width is the chunk's element size, chosen per chunk from its dtypes.
Compression is skipped when it does not shrink the chunk, so incompressible data costs one
attempt, never extra bytes on disk.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Literal, Protocol, cast

import torch
import zstandard

from tierstate.errors import TierstateError

_local = threading.local()
Codec = Literal["none", "zstd"]
ShuffleWidth = Literal[1, 2, 4, 8, 16]
SHUFFLE_WIDTHS: tuple[ShuffleWidth, ...] = (1, 2, 4, 8, 16)


class CodecError(TierstateError, ValueError):
    """A frame that cannot be decoded with the codec its manifest names."""


@dataclass(frozen=True)
class Encoded:
    data: bytes
    codec: Codec
    shuffle: ShuffleWidth


def _compressor(level: int, threads: int) -> zstandard.ZstdCompressor:
    # ZstdCompressor objects are not thread-safe; one per thread and setting is cheap and reused.
    cache = _local.__dict__.setdefault("compressors", {})
    key = (level, threads)
    if key not in cache:
        cache[key] = zstandard.ZstdCompressor(level=level, threads=threads)
    return cache[key]


def _planes(data: bytes | memoryview, width: int, inverse: bool) -> bytes | memoryview:
    if width == 1 or not len(data):
        return data
    with warnings.catch_warnings():  # read-only input is only read here
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8)
    shape = (width, -1) if inverse else (-1, width)
    return flat.view(shape).t().contiguous().numpy().data.cast("B")


def shuffle(data: bytes | memoryview, width: int) -> bytes | memoryview:
    """Byte planes of ``width``-byte elements; ``len(data)`` must be a multiple of ``width``."""
    return _planes(data, width, inverse=False)


def unshuffle(data: bytes | memoryview, width: int) -> bytes | memoryview:
    return _planes(data, width, inverse=True)


def compress(raw: bytes | memoryview, level: int, threads: int = 0, width: int = 1) -> Encoded | None:
    """zstd-compress ``raw`` (byte-shuffled by ``width`` first); None when that would not shrink it."""
    if width not in SHUFFLE_WIDTHS or len(raw) % width:
        width = 1
    packed = _compressor(level, threads).compress(shuffle(raw, width))
    return Encoded(packed, "zstd", width) if len(packed) < len(raw) else None


class _Overflow(Exception):
    """The compressed stream reached the raw size: compression would not shrink this chunk."""


class _SlabSink:
    """A file-like target for zstd's stream writer that fills a preallocated buffer, so the compressed
    bytes never exist as a second, chunk-sized Python object outside the host cache."""

    def __init__(self, out: memoryview, limit: int) -> None:
        self.out, self.limit, self.length = out, limit, 0

    def write(self, data: bytes) -> int:
        end = self.length + len(data)
        if end > self.limit:
            raise _Overflow
        self.out[self.length : end] = data
        self.length = end
        return len(data)


def compress_into(
    raw: memoryview, scratch: torch.Tensor, level: int, threads: int = 0, width: int = 1
) -> tuple[int, ShuffleWidth] | None:
    """Compress ``raw`` (writable, e.g. a host-cache slab) in place, using ``scratch`` (>= len(raw) bytes).

    On success the zstd frame of the shuffled bytes is in ``raw[:length]`` and ``(length, width)``
    is returned; None when it would not shrink, with ``raw`` as it was. Memory stays within the two
    buffers: the shuffle goes into ``scratch`` and the frame streams back over ``raw`` (or, without a
    shuffle, into ``scratch`` and is then copied over ``raw``).
    """
    n = len(raw)
    if width not in SHUFFLE_WIDTHS or n % width:
        width = 1
    if n == 0:
        return None
    source = torch.frombuffer(raw, dtype=torch.uint8)
    spare = scratch[:n]
    if width > 1:
        spare.view(width, -1).copy_(source.view(-1, width).t())
        data, sink = spare.numpy().data, _SlabSink(raw, n - 1)
    else:
        data, sink = raw, _SlabSink(spare.numpy().data, n - 1)
    # The stub asks for a whole IO[bytes]; zstandard calls only write() on it (flush() if it had one).
    target = cast(IO[bytes], sink)
    try:
        with _compressor(level, threads).stream_writer(target, size=n, write_size=1 << 20, closefd=False) as writer:
            writer.write(data)
    except _Overflow:
        if width > 1:  # raw was partly overwritten: put the original bytes back from the shuffled copy
            source.view(-1, width).copy_(spare.view(width, -1).t())
        return None
    if width == 1:
        raw[: sink.length] = sink.out[: sink.length]
    return sink.length, width


DECODE_BLOCK = 1 << 20  # zstd output is handed on in blocks of this size: memory per decoder, whatever the frame


class Readable(Protocol):
    """Stored bytes read as a stream (a file, or a frame read from one), for frames not held whole."""

    def read(self, size: int = -1, /) -> bytes: ...


def zstd_blocks(stored: bytes | memoryview | Readable, raw_length: int) -> Iterator[bytes]:
    """The decoded bytes of a zstd frame, in blocks.

    Streaming, so memory is one block plus zstd's window however far the frame expands: a frame
    within zstd's ratio can still claim gigabytes, and only the bytes a reader wants are kept (by
    it). The frame must decode to exactly its ``raw_length``: a CodecError when it ends short of it
    or goes beyond it.
    """
    done = 0
    try:
        # A stream needs only read(): zstandard takes any object that has one.
        source = stored if isinstance(stored, bytes | memoryview) else cast("IO[bytes]", stored)
        with zstandard.ZstdDecompressor().stream_reader(source) as reader:
            while done < raw_length:
                block = reader.read(min(DECODE_BLOCK, raw_length - done))
                if not block:
                    break
                done += len(block)
                yield block
            if reader.read(1):
                raise CodecError(f"zstd frame decodes to more than the {raw_length} bytes the manifest says")
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd frame does not decode: {exc}") from None
    if done < raw_length:
        raise CodecError(f"zstd frame decodes to {done} bytes, manifest says {raw_length}")


def decompress(stored: bytes | memoryview, codec: str, raw_length: int, width: int = 1) -> bytes | memoryview:
    """A whole frame decoded into one buffer of ``raw_length`` bytes (readers stream instead, see
    :func:`zstd_blocks`)."""
    if codec == "none":
        return stored
    if codec != "zstd":
        raise CodecError(f"unknown codec {codec!r}")
    if width not in SHUFFLE_WIDTHS or raw_length % width:
        raise CodecError(f"invalid shuffle width {width} for {raw_length} bytes")
    raw = bytearray(raw_length)
    position = 0
    for block in zstd_blocks(stored, raw_length):
        raw[position : position + len(block)] = block
        position += len(block)
    return unshuffle(memoryview(raw), width)
