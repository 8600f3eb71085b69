"""Names for tensor dtypes on disk.

A manifest stores a dtype as its bare name (``"bfloat16"``). Reading maps the name back only
through this table, so a manifest naming something that is not a plain tensor dtype (or a dtype
this torch does not have) is refused instead of being passed to ``getattr(torch, ...)``.
"""

from __future__ import annotations

import torch

from tierstate.errors import TierstateError


class UnknownDtypeError(TierstateError, ValueError):
    """A dtype name in a checkpoint that this torch cannot represent as a dense tensor."""


_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


def _storable_dtypes() -> dict[str, torch.dtype]:
    # Quantized dtypes carry scale/zero-point beside the bytes; raw bytes alone would lose them.
    table = {}
    for name in dir(torch):
        value = getattr(torch, name)
        if isinstance(value, torch.dtype) and value not in _QUANTIZED:
            table[str(value).removeprefix("torch.")] = value
    return table


DTYPES: dict[str, torch.dtype] = _storable_dtypes()


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if DTYPES.get(name) is not dtype:
        raise UnknownDtypeError(f"dtype {dtype} cannot be stored as raw bytes")
    return name


def dtype_from_name(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise UnknownDtypeError(
            f"unknown dtype {name!r} (this torch {torch.__version__} knows: {', '.join(sorted(DTYPES))})"
        )
    return DTYPES[name]
