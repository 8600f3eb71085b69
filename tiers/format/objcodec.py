"""On-disk encoding of object items: msgpack (default), json, or pickle when the policy allows it.

msgpack keeps what optimizer and scheduler state needs and json loses: integer map keys, tuples
(as an extension type, nested too) and bytes. Pickle can run arbitrary code when loaded, so it is
refused, in both directions, unless ``policies.allow_pickle: true`` is set. Encoding is
deterministic: the same value built the same way gives the same bytes (dict insertion order kept,
floats always 64-bit, fixed pickle protocol).

Nesting is bounded by :data:`MAX_DEPTH` both ways, for msgpack and json: an object deeper than that
fails its checkpoint with an error, and data claiming more is refused when read, with our error.
Unbounded, a tuple nested a few hundred deep checkpointed fine and then crashed every restore: the
msgpack decoder, called again for each nested tuple, overflowed the C stack (SIGSEGV).
"""

from __future__ import annotations

import json
import pickle
from typing import Any, cast

import msgpack

from tierstate.errors import TierstateError

try:
    import numpy as np
except ImportError:  # without numpy there are no numpy scalars to convert
    np = None

_TUPLE_EXT = 1
MAX_DEPTH = 100
"""Most levels of dicts, lists and tuples (map keys included) one object may nest."""
_TOO_DEEP = f"deeper than {MAX_DEPTH} levels of dicts, lists and tuples"
_PICKLE_PROTOCOL = 5
_DEPTH_BOUNDED = ("msgpack", "json")  # pickle bounds its own recursion (RecursionError), and is trusted data
_PICKLE_DISABLED = (
    "pickle is disabled because loading a pickle can run arbitrary code; set `policies.allow_pickle: true` "
    "in the pipeline YAML to allow it for checkpoints you trust, or use serializer 'msgpack' or 'json'"
)


class ObjectCodecError(TierstateError, ValueError):
    """An object cannot be encoded or decoded with the chosen serializer, or pickle is not allowed."""


def _type_name(value: Any) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _unsupported(serializer: str, value: Any, other: str) -> ObjectCodecError:
    return ObjectCodecError(
        f"{serializer} cannot encode a value of type {_type_name(value)}; convert it to plain "
        f"dicts/lists/numbers/strings, or use serializer {other}"
    )


def _msgpack_default(value: Any) -> Any:
    """Called by msgpack (strict types) for everything it does not pack natively."""
    if isinstance(value, tuple):
        return msgpack.ExtType(_TUPLE_EXT, _pack(list(value)))
    if isinstance(value, dict):  # OrderedDict, defaultdict: stored as a plain dict
        return dict(value)
    if isinstance(value, list):
        return list(value)
    if np is not None and isinstance(value, np.generic) and not isinstance(value, np.void):
        return value.item()
    raise _unsupported("msgpack", value, "'pickle' (needs policies.allow_pickle: true)")


def _pack(value: Any) -> bytes:
    # strict_types: tuples and subclasses (OrderedDict, numpy floats) reach the default hook instead of
    # being packed as lists / their base type
    packed = msgpack.packb(value, default=_msgpack_default, use_bin_type=True, strict_types=True)
    return cast(bytes, packed)  # msgpack is untyped; packb without a stream always returns bytes


class _Decoder:
    """One msgpack decode: nested tuples are decoded as they are met, each by a heap-allocated
    ``Unpacker`` (``unpackb`` keeps ~40 KiB of state on the C stack per call) and at most
    :data:`MAX_DEPTH` deep, so hostile data cannot run the thread out of stack."""

    def __init__(self) -> None:
        self.tuples = 0  # tuples being decoded, one inside the other

    def decode(self, data: bytes | bytearray | memoryview) -> Any:
        return msgpack.unpackb(data, ext_hook=self._ext, raw=False, strict_map_key=False, use_list=True)

    def _ext(self, code: int, data: bytes) -> Any:
        if code != _TUPLE_EXT:
            raise ObjectCodecError(f"msgpack data has an unknown extension type {code}")
        if self.tuples >= MAX_DEPTH:
            raise ObjectCodecError(f"msgpack data nests tuples {_TOO_DEEP}, more than tierstate writes")
        self.tuples += 1
        try:
            unpacker = msgpack.Unpacker(
                ext_hook=self._ext, raw=False, strict_map_key=False, use_list=True, max_buffer_size=max(1, len(data))
            )
            unpacker.feed(data)
            inner = unpacker.unpack()
            if unpacker.tell() != len(data):
                raise ObjectCodecError(f"msgpack tuple data has {len(data) - unpacker.tell()} bytes after its end")
            return tuple(inner)
        finally:
            self.tuples -= 1


def _deeper_than_bound(value: Any) -> bool:
    """Whether ``value`` nests dicts, lists or tuples (map keys too) more than :data:`MAX_DEPTH` deep.

    Iterative, so checking the deepest object costs no stack; a cycle counts as too deep.
    """
    pending = [(value, 1)]
    while pending:
        node, depth = pending.pop()
        if not isinstance(node, dict | list | tuple):
            continue
        if depth > MAX_DEPTH:
            return True
        children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
        pending.extend((child, depth + 1) for child in children if isinstance(child, dict | list | tuple))
    return False


def _json_default(value: Any) -> Any:
    raise _unsupported("json", value, "'msgpack', or 'pickle' (needs policies.allow_pickle: true)")


def encode_object(value: Any, serializer: str = "msgpack", allow_pickle: bool = False) -> bytes:
    """Encode ``value`` with ``serializer``; raises :class:`ObjectCodecError` naming what failed."""
    if serializer in _DEPTH_BOUNDED and _deeper_than_bound(value):
        raise ObjectCodecError(
            f"{serializer} cannot encode this {_type_name(value)}: it nests {_TOO_DEEP} (or contains itself); "
            "flatten it, or keep the deep part in a tensor"
        )
    try:
        if serializer == "msgpack":
            return _pack(value)
        if serializer == "json":
            return json.dumps(value, allow_nan=True, default=_json_default, separators=(",", ":")).encode("utf-8")
        if serializer == "pickle":
            if not allow_pickle:
                raise ObjectCodecError(_PICKLE_DISABLED)
            return pickle.dumps(value, protocol=_PICKLE_PROTOCOL)
    except ObjectCodecError:
        raise
    except (TypeError, ValueError, OverflowError, AttributeError, RecursionError, pickle.PicklingError) as exc:
        raise ObjectCodecError(f"{serializer} cannot encode a value of type {_type_name(value)}: {exc}") from exc
    raise ObjectCodecError(f"unknown serializer {serializer!r}, expected 'msgpack', 'json' or 'pickle'")


def decode_object(data: bytes | bytearray | memoryview, serializer: str = "msgpack", allow_pickle: bool = False) -> Any:
    """Decode bytes written by :func:`encode_object`; refuses pickle, without unpickling, unless allowed,
    and msgpack or json data nested deeper than :func:`encode_object` writes."""
    try:
        if serializer == "msgpack":
            value = _Decoder().decode(data)
        elif serializer == "json":
            value = json.loads(bytes(data).decode("utf-8"))
        elif serializer == "pickle":
            if not allow_pickle:
                raise ObjectCodecError(_PICKLE_DISABLED)
            return pickle.loads(data)
        else:
            raise ObjectCodecError(f"unknown serializer {serializer!r}, expected 'msgpack', 'json' or 'pickle'")
    except ObjectCodecError:
        raise
    except Exception as exc:  # corrupt data; unpickling can raise anything the pickled classes raise
        raise ObjectCodecError(f"cannot decode {serializer} object data: {exc!r}") from exc
    if _deeper_than_bound(value):
        raise ObjectCodecError(f"{serializer} data nests {_TOO_DEEP}, more than tierstate writes")
    return value
