"""The names of a checkpoint and of a rank's files in it, and reading a step or rank back out of a name.

A checkpoint of step N is ``step-N`` (a directory, or a bucket's ``step-N/`` prefix), written with
no leading zeros. Each rank writes one data file (``rank-NNNNN.data`` in the frames container,
``rank-NNNNN.h5`` in HDF5) and one index (``rank-NNNNN.index``). Writers, listings, the manifest's
name checks, format conversion and restore's "who wrote this" all use this one grammar, so a name
one of them writes is a name the others accept. Parsing is strict (ASCII digits only, nothing after
the name; a step without leading zeros, so ``step-04`` is no name of step 4 and is never listed as
it): a manifest names files only this way, which is what keeps its paths inside the checkpoint
directory.
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple, cast

RankFileKind = Literal["data", "h5", "index"]
DATA_KINDS: tuple[RankFileKind, ...] = ("data", "h5")  # the frames container, the HDF5 container

# \Z, not $: "$" also matches before a trailing newline; [0-9], not \d: \d matches any Unicode digit.
_RANK_FILE = re.compile(r"^rank-([0-9]{5})\.(data|h5|index)\Z")
_RANK_DIR = re.compile(r"^rank-([0-9]{5})\Z")
#: A step as its name spells it: no leading zero (``step-04`` names nothing), at most 18 digits (a manifest's
#: steps stay below 2**50; int() of a name of thousands of digits would raise instead of answering None).
STEP_NUMBER = r"(0|[1-9][0-9]{0,17})"
STEP_PREFIX = "step-"
_STEP = re.compile(rf"^{STEP_PREFIX}{STEP_NUMBER}\Z")


class RankFile(NamedTuple):
    """A parsed rank file name: whose it is and what it holds."""

    rank: int
    kind: RankFileKind


def step_name(step: int) -> str:
    """The name of step ``step``'s checkpoint: ``step-12``."""
    return f"{STEP_PREFIX}{step}"


def parse_step_name(name: str) -> int | None:
    """The step ``name`` is the checkpoint name of, or None (``step-04``, ``step-4x``, a non-ASCII digit)."""
    match = _STEP.match(name)
    return None if match is None else int(match.group(1))


def rank_file_name(rank: int, kind: RankFileKind) -> str:
    """The name of ``rank``'s file of ``kind``: ``rank-00003.data``."""
    return f"rank-{rank:05d}.{kind}"


def rank_dir_name(rank: int) -> str:
    """The name of a directory of ``rank``'s own (its slot pool in a memory tier: tiers/storage/slotdirs.py)."""
    return f"rank-{rank:05d}"


def parse_rank_dir(name: str) -> int | None:
    """The rank whose own directory ``name`` is (:func:`rank_dir_name`), or None."""
    match = _RANK_DIR.match(name)
    return None if match is None else int(match.group(1))


def data_file_name(rank: int) -> str:
    """``rank``'s data file in the frames container."""
    return rank_file_name(rank, "data")


def hdf5_file_name(rank: int) -> str:
    """``rank``'s data file in the HDF5 container."""
    return rank_file_name(rank, "h5")


def index_file_name(rank: int) -> str:
    """``rank``'s index: its data file's frames and the items it wrote."""
    return rank_file_name(rank, "index")


def parse_rank_file(name: str) -> RankFile | None:
    """The rank and kind ``name`` names, or None when it is not a rank file name at all."""
    match = _RANK_FILE.match(name)
    if match is None:
        return None
    return RankFile(int(match.group(1)), cast(RankFileKind, match.group(2)))


def data_file_rank(name: str) -> int | None:
    """The rank whose data file (either container) ``name`` is, or None when it names no data file."""
    parsed = parse_rank_file(name)
    return parsed.rank if parsed is not None and parsed.kind in DATA_KINDS else None
