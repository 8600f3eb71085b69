"""Byte units, sizes given as text, and how every table prints seconds, ratios and bytes."""

from __future__ import annotations

from pydantic import ByteSize, TypeAdapter

GB = 1e9
MiB = 1 << 20
GiB = 1 << 30


def parse_size(text: str) -> int:
    """Bytes of ``text`` as the YAML config reads a size: ``1.5GiB``, ``256MiB``, ``100MB``, ``4096``."""
    return int(TypeAdapter(ByteSize).validate_python(text))


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else float("inf")


def fmt_s(seconds: float) -> str:
    if seconds != seconds:  # nan
        return "-"
    if seconds < 0.1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def fmt_ratio(value: float) -> str:
    if value != value or value == float("inf"):
        return "-"
    return f"{value:.0f}x" if value >= 10 else f"{value:.2f}x"


def fmt_bytes(nbytes: float) -> str:
    for unit, size in (("GB", GB), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"
