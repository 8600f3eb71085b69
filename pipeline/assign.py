"""Who does the work nobody in particular must do: writing a replicated item, reading a shared one.

Every rank computes the assignment from the same gathered description, so all agree on it
without another round of messages. Greedy, largest first, each to the least loaded rank that can
do it: within one item of the best balance, and deterministic (ties go to the lower rank, keys
are sorted), which is what lets ranks compute it independently.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def balance(
    sizes: Mapping[K, int], holders: Mapping[K, Sequence[int]], load: Mapping[int, int] | None = None
) -> dict[K, int]:
    """Map each key to one of its ``holders`` (ranks able to do it), spreading ``sizes`` (bytes).

    ``load`` is what each rank already has to do (e.g. its per-rank bytes), so the balance covers
    the whole job, not only the shared part.
    """
    totals = dict(load or {})
    chosen: dict[K, int] = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], repr(k))):
        candidates = sorted(set(holders[key]))
        if not candidates:
            raise ValueError(f"{key!r}: no rank holds it")
        rank = min(candidates, key=lambda r: (totals.get(r, 0), r))
        chosen[key] = rank
        totals[rank] = totals.get(rank, 0) + sizes[key]
    return chosen
