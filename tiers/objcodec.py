"""On-disk encoding of object items: msgpack (default), json, or pickle when the policy allows it.

msgpack keeps what optimizer and scheduler state needs and json loses: integer map keys, tuples
(as an extension type, nested too) and bytes. Pickle can run arbitrary code when loaded, so it is
refused, in both directions, unless ``policies.allow_pickle: true`` is set. Encoding is
deterministic: the same value built the same way gives the same bytes (dict insertion order kept,
floats always 64-bit, fixed pickle protocol).
"""

from __future__ import annotations

import json
import pickle
from typing import Any

import msgpack

from tierstate.errors import TierstateError

try:
    import numpy as np
except ImportError:  # without numpy there are no numpy scalars to convert
    np = None

_TUPLE_EXT = 1
_PICKLE_PROTOCOL = 5
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
    return msgpack.packb(value, default=_msgpack_default, use_bin_type=True, strict_types=True)


def _msgpack_ext_hook(code: int, data: bytes) -> Any:
    if code == _TUPLE_EXT:
        return tuple(_unpack(data))
    raise ObjectCodecError(f"msgpack data has an unknown extension type {code}")


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_msgpack_ext_hook, raw=False, strict_map_key=False, use_list=True)


def _json_default(value: Any) -> Any:
    raise _unsupported("json", value, "'msgpack', or 'pickle' (needs policies.allow_pickle: true)")


def encode_object(value: Any, serializer: str = "msgpack", allow_pickle: bool = False) -> bytes:
    """Encode ``value`` with ``serializer``; raises :class:`ObjectCodecError` naming what failed."""
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
    except (TypeError, ValueError, OverflowError, AttributeError, pickle.PicklingError) as exc:
        raise ObjectCodecError(f"{serializer} cannot encode a value of type {_type_name(value)}: {exc}") from exc
    raise ObjectCodecError(f"unknown serializer {serializer!r}, expected 'msgpack', 'json' or 'pickle'")


def decode_object(data: bytes | bytearray | memoryview, serializer: str = "msgpack", allow_pickle: bool = False) -> Any:
    """Decode bytes written by :func:`encode_object`; refuses pickle, without unpickling, unless allowed."""
    try:
        if serializer == "msgpack":
            return _unpack(data)
        if serializer == "json":
            return json.loads(bytes(data).decode("utf-8"))
        if serializer == "pickle":
            if not allow_pickle:
                raise ObjectCodecError(_PICKLE_DISABLED)
            return pickle.loads(data)
    except ObjectCodecError:
        raise
    except Exception as exc:  # corrupt data; unpickling can raise anything the pickled classes raise
        raise ObjectCodecError(f"cannot decode {serializer} object data: {exc!r}") from exc
    raise ObjectCodecError(f"unknown serializer {serializer!r}, expected 'msgpack', 'json' or 'pickle'")
