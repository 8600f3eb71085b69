"""Boxes: axis-aligned regions of a global tensor, the geometry of shards and of resharding.

A shard is the box ``[offsets, offsets + shape)`` of its global tensor. Saving on one world size
and loading on another reduces to intersecting the boxes that were written with the box a rank
wants now. Kept free of torch and of the manifest so the format can validate shards with it and
the reader can slice with it, without either importing the other.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product


@dataclass(frozen=True)
class Box:
    """The elements ``offsets[d] <= i[d] < offsets[d] + shape[d]`` of a tensor, in every dimension d."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.shape):
            raise ValueError(f"box offsets {self.offsets} and shape {self.shape} differ in rank")

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.shape, strict=True))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def within(self, shape: Sequence[int]) -> bool:
        """Whether the box lies inside a tensor of ``shape`` (same rank, no element outside)."""
        return len(shape) == len(self.shape) and all(e <= s for e, s in zip(self.end, shape, strict=True))

    def intersect(self, other: Box) -> Box | None:
        """The common region, or None when it holds no element."""
        start = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=True))
        stop = tuple(min(a, b) for a, b in zip(self.end, other.end, strict=True))
        if any(lo >= hi for lo, hi in zip(start, stop, strict=True)):
            return None
        return Box(start, tuple(hi - lo for lo, hi in zip(start, stop, strict=True)))

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which must contain it)."""
        return Box(tuple(a - b for a, b in zip(self.offsets, outer.offsets, strict=True)), self.shape)


MAX_CORNERS = 1 << 22  # corners the exact tiling check may count: 4000 shards split in 10 dimensions
MAX_COMPARISONS = 1 << 20  # pairs of shards compared, at most, to name two that overlap


def tiling_problem(boxes: Sequence[Box], shape: Sequence[int]) -> str | None:
    """Why ``boxes`` do not tile a tensor of ``shape`` exactly once (outside, overlap, gap), or None.

    Exact tiling is checked by counting corners, in time linear in the boxes: give each corner of a
    box the sign ``(-1)^k``, k = how many of its coordinates are upper ends. These signed corners
    determine a sum of box indicators (prefix sums over them give it back), so the boxes cover every
    element exactly once if and only if their corner counts add up to the whole shape's: +1 or -1 at
    its own corners, 0 everywhere else. Only the dimensions some box splits count (the others
    contribute the same factor to every box), so a box has 2^k corners for k split dimensions.
    When they do not tile, a sweep looks for an overlap to name (within a bounded number of
    comparisons, as forged shards can make any sweep quadratic).
    """
    for box in boxes:
        if not box.within(shape):
            return f"shard at {list(box.offsets)} of shape {list(box.shape)} lies outside {list(shape)}"
    filled = [b for b in boxes if b.numel]
    split = [d for d in range(len(shape)) if any(b.shape[d] != shape[d] for b in filled)]
    if len(filled) << len(split) > MAX_CORNERS:
        return f"{len(filled)} shards split {len(split)} dimensions: too many to check that they tile {list(shape)}"
    if _corner_counts(filled, split) == _corner_counts([Box.whole(shape)], split):
        return None
    overlap = _overlapping_pair(filled, split)
    if overlap is not None:
        first, second = overlap
        return f"shards at {list(first.offsets)} and {list(second.offsets)} overlap"
    covered, total = sum(b.numel for b in filled), math.prod(shape)
    if covered != total:
        return f"shards cover {covered} of the {total} elements of {list(shape)}"
    return f"shards overlap and leave a gap in {list(shape)}"


def _corner_counts(boxes: Sequence[Box], dims: Sequence[int]) -> dict[tuple[int, ...], int]:
    """The signed corners of ``boxes`` in dimensions ``dims`` (see :func:`tiling_problem`), zeros dropped."""
    counts: dict[tuple[int, ...], int] = defaultdict(int)
    for box in boxes:
        if not box.numel:
            continue
        ends = [(box.offsets[d], box.offsets[d] + box.shape[d]) for d in dims]
        for upper in product((0, 1), repeat=len(dims)):
            counts[tuple(end[u] for end, u in zip(ends, upper, strict=True))] += -1 if sum(upper) % 2 else 1
    return {corner: count for corner, count in counts.items() if count}


def _overlapping_pair(boxes: Sequence[Box], dims: Sequence[int]) -> tuple[Box, Box] | None:
    """Two boxes that overlap, found by sweeping along the split dimension where boxes overlap least;
    None if there are none, or none among the first MAX_COMPARISONS pairs compared."""
    if not boxes or not dims:
        return (boxes[0], boxes[1]) if len(boxes) > 1 else None
    axis = min(dims, key=lambda d: _sweep_cost(boxes, d))
    ordered = sorted(boxes, key=lambda b: b.offsets[axis])
    budget = MAX_COMPARISONS
    for i, box in enumerate(ordered):
        for later in ordered[i + 1 :]:
            if later.offsets[axis] >= box.end[axis]:
                break
            if box.intersect(later) is not None:
                return box, later
            budget -= 1
            if not budget:
                return None
    return None


def _sweep_cost(boxes: Sequence[Box], axis: int) -> int:
    """How many pairs of boxes a sweep along ``axis`` compares: those whose extents on it overlap."""
    starts = sorted(b.offsets[axis] for b in boxes)
    return sum(bisect_left(starts, b.end[axis]) - bisect_right(starts, b.offsets[axis]) for b in boxes)
