"""Boxes: axis-aligned regions of a global tensor, the geometry of shards and of resharding.

A shard is the box ``[offsets, offsets + shape)`` of its global tensor. Saving on one world size
and loading on another reduces to intersecting the boxes that were written with the box a rank
wants now. Kept free of torch and of the manifest so the format can validate shards with it and
the reader can slice with it, without either importing the other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


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


def tiling_problem(boxes: Sequence[Box], shape: Sequence[int]) -> str | None:
    """Why ``boxes`` do not tile a tensor of ``shape`` exactly once (outside, overlap, gap), or None.

    Boxes inside the shape that never overlap tile it exactly when their volumes add up to its
    volume. Overlaps are found by sweeping along dimension 0, so the usual row-split shards cost
    n log n comparisons, not n squared.
    """
    for box in boxes:
        if not box.within(shape):
            return f"shard at {list(box.offsets)} of shape {list(box.shape)} lies outside {list(shape)}"
    filled = [b for b in boxes if b.numel]
    if shape:
        filled.sort(key=lambda b: b.offsets)
        for i, box in enumerate(filled):
            for later in filled[i + 1 :]:
                if later.offsets[0] >= box.end[0]:
                    break
                if box.intersect(later) is not None:
                    return f"shards at {list(box.offsets)} and {list(later.offsets)} overlap"
    covered, total = sum(b.numel for b in filled), math.prod(shape)
    if covered != total:
        return f"shards cover {covered} of the {total} elements of {list(shape)}"
    return None
