"""The pipeline YAML's stage chain: each stage kind as a strict, immutable pydantic model, and the shared
bases of every section of the schema (pipeline/config_schema.py).

A stage has workers (threads), the bound of the queue feeding it and its successor (``next``); each
kind adds its own settings. The chain's shape (one capture, one persist, no cycle) is checked across
stages by pipeline/stage_graph.py.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    StrictInt,
    field_validator,
)

MiB = 1 << 20

StageKind = Literal["capture", "serialize", "compress", "persist"]
STAGE_KINDS: tuple[str, ...] = typing.get_args(StageKind)


class Strict(BaseModel):
    """Base for every section: unknown keys are errors (typos must not be silently ignored), and a
    loaded config is immutable because runner threads share it."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def at_least(minimum: int) -> AfterValidator:
    """A size lower bound whose message is in human units (``1.0MiB``), not raw byte counts."""

    def check(value: ByteSize) -> ByteSize:
        if value < minimum:
            floor = ByteSize(minimum).human_readable()
            raise ValueError(f"must be at least {floor}, got {value.human_readable()}")
        return value

    return AfterValidator(check)


class StageBase(Strict):
    """Fields every stage has: its worker thread count, the bound of its input queue, its successor."""

    kind: StageKind
    # 0: no threads of its own; the threads of the stage before it run it too (pipeline/lanes.py).
    workers: Annotated[StrictInt, Field(ge=0)] = 1
    queue: Annotated[StrictInt, Field(ge=1)] = 4
    next: str | None = None


def capture_workers_for_host() -> int:
    """``workers: auto`` of capture: the cores this process may run on, less one kept for the
    trainer's own thread, between 1 and 2. Each capture worker copies and checksums at memory speed;
    on a 2-core host a second one only takes the core the trainer needs (measured: it doubled a
    Python-bound trainer's step-time inflation), and two already copy faster than a disk writes."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(2, cores - 1))


def _auto_workers(value: object) -> object:
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"must be a whole number of workers or 'auto', got {value!r}")
        return capture_workers_for_host()
    return value


class CaptureStage(StageBase):
    """Copies device tensors into host-cache slabs (lazy: overlapped with forward/backward)."""

    kind: Literal["capture"] = "capture"  # pyright: ignore[reportIncompatibleVariableOverride]  (the union tag)
    # ``auto`` (the default) is resolved when the config loads: capture_workers_for_host().
    workers: Annotated[StrictInt, Field(ge=1), BeforeValidator(_auto_workers)] = Field(
        default_factory=capture_workers_for_host
    )


class SerializeStage(StageBase):
    """Lays items out as frames in chunks and serializes metadata and Python objects."""

    kind: Literal["serialize"] = "serialize"  # pyright: ignore[reportIncompatibleVariableOverride]  (the union tag)


class CompressStage(StageBase):
    """Optional compression of chunks; ``codec: none`` keeps the stage but passes bytes through."""

    kind: Literal["compress"] = "compress"  # pyright: ignore[reportIncompatibleVariableOverride]  (the union tag)
    codec: Literal["none", "zstd"] = "zstd"
    level: Annotated[StrictInt, Field(ge=-7, le=22)] = 1  # configs/compressed.yaml says why
    threads: Annotated[StrictInt, Field(ge=0)] = 0
    # Byte-shuffle by the chunk's element size before zstd (auto), or compress the bytes as they are (off).
    shuffle: Literal["auto", "off"] = "auto"


class PersistStage(StageBase):
    """Writes chunks to the first durable tier; ``bandwidth`` (bytes/s) throttles it, null = unlimited."""

    kind: Literal["persist"] = "persist"  # pyright: ignore[reportIncompatibleVariableOverride]  (the union tag)
    tier: str
    bandwidth: Annotated[ByteSize, at_least(1)] | None = None
    # Transient write errors (ENOSPC, EIO, ...) of a frame or the index are retried this many times,
    # waiting `backoff` seconds before the first retry and doubling; fsync and commit are never retried.
    retries: Annotated[StrictInt, Field(ge=0, le=100)] = 0
    backoff: Annotated[float, Field(gt=0, le=600)] = 0.5
    # auto: raw slabs are written with O_DIRECT where the file system allows it (no page-cache copy);
    # buffered: always through the page cache (for file systems whose O_DIRECT path is slow).
    io: Literal["auto", "buffered"] = "auto"
    # frames: the tierstate data file; hdf5: an HDF5 file per rank, one dataset per tensor (tiers/format/hdf5.py).
    format: Literal["frames", "hdf5"] = "frames"


StageConfig = Annotated[
    CaptureStage | SerializeStage | CompressStage | PersistStage,
    Field(discriminator="kind"),
]


class PipelineSpec(Strict):
    """The stage graph: named stages linked by ``next`` into one chain starting at capture."""

    stages: dict[str, StageConfig]

    @field_validator("stages", mode="before")
    @classmethod
    def _kind_from_name(cls, stages: Any) -> Any:
        # Lets the common case (a stage named after its kind) omit `kind` without giving up the
        # discriminated union, which is what yields per-kind errors at precise key paths.
        if not isinstance(stages, Mapping):
            return stages
        return {
            name: {**stage, "kind": name}
            if isinstance(stage, Mapping) and "kind" not in stage and name in STAGE_KINDS
            else stage
            for name, stage in stages.items()
        }
