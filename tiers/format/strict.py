"""The strict base of every record stored in a checkpoint, and the bounded numbers they hold.

A record is read from a tier, which may be shared, so it is refused rather than half-read: unknown
keys fail validation (a newer or forged file is not silently trimmed) and every size is bounded
before a byte is allocated for it. Its own module so that the manifest, item, index and stats
records can live apart without importing each other for their base.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

MAX_BYTES = 1 << 50  # far beyond any real checkpoint; rejects absurd sizes before allocation

NonNegative = Annotated[int, Field(ge=0, le=MAX_BYTES)]
Measure = Annotated[float, Field(ge=0, allow_inf_nan=False)]  # seconds, GB/s


class Strict(BaseModel):
    """A stored record: unknown keys refused, frozen once validated (a checked value stays checked)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
