"""A fresh start on tiers that hold an earlier run's checkpoints: refused, or the old run set aside.

Why: a run started over (HF ``train(resume_from_checkpoint=False)``, Lightning without ``ckpt_path``,
a plain loop) on such tiers mixes with the old run without a word: its steps collide with the old
ones and, after a crash before it passes the old run's newest step, a resume finds the *old* run.
So a fresh start is explicit: with nothing on the tiers it is free; otherwise it either fails up
front (:class:`ExistingCheckpointsError`, naming tiers and steps) or, asked to, renames the old
run's checkpoints aside (tiers/ops/setaside.py) so the new run is the one ``latest`` finds.
Collective with many ranks: every rank decides alike from what all of them see.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Sequence

from tierstate.errors import TierstateError

from ..tiers.ops.setaside import SET_ASIDE_PREFIX, holdings, set_aside
from ..tiers.storage.filesystem import FilesystemTier, TierError
from ..tiers.storage.s3tier import S3Tier
from .distributed import CheckpointGroup


class ExistingCheckpointsError(TierstateError, FileExistsError):
    """A fresh start on tiers that hold another run's checkpoints, without leave to set them aside."""


def _held(tiers: Sequence[FilesystemTier]) -> dict[str, list[int]]:
    return {f"{name} ({tier.root})": steps for tier in tiers for name, steps in holdings(tier).items()}


def _held_in(buckets: Sequence[S3Tier]) -> tuple[dict[str, list[int]], list[str]]:
    """The buckets' committed steps by tier, and why a bucket could not be listed."""
    held, unlisted = {}, []
    for bucket in buckets:
        label = f"{bucket.name} ({bucket.store.where()})"
        try:
            steps = bucket.steps()
        except OSError as exc:
            unlisted.append(f"tier {label}: {exc}")
            continue
        if steps:
            held[label] = steps
    return held, unlisted


def start_fresh(
    tiers: Sequence[FilesystemTier],
    buckets: Sequence[S3Tier],
    group: CheckpointGroup | None,
    settle: Callable[[], object],
    aside: bool,
) -> dict[str, list[int]]:
    """Make the tiers empty of committed checkpoints for a new run; what they held, by tier.

    ``settle`` first waits for the background flushes a crashed run left (they complete the old
    run's copies, which are then set aside with the rest). ``aside``: rename the old checkpoints
    aside instead of refusing. A bucket holding checkpoints refuses either way (an object store has
    no rename), before anything is set aside: its old steps would otherwise be what ``latest`` finds.
    A bucket that cannot be listed fails it with a :class:`TierError` naming the bucket.
    """
    settle()
    seen = _held(tiers)
    in_buckets, unlisted = _held_in(buckets)
    if group is not None:
        said = group.all_gather((seen, in_buckets, unlisted), "fresh start: what the tiers hold")
        seen = {name: steps for each, _b, _u in said for name, steps in each.items()}
        in_buckets = {name: steps for _s, each, _u in said for name, steps in each.items()}
        unlisted = [text for _s, _b, each in said for text in each]
    if unlisted:  # whether it holds an old run is unknown: not refused for holding one, failed for the bucket
        raise TierError(
            errno.EIO,
            f"a fresh start cannot tell whether a bucket holds an earlier run's checkpoints, it could not be "
            f"listed: {'; '.join(unlisted)}; fix access to it (endpoint, credentials, bucket) and start again",
        )
    if not seen and not in_buckets:
        return {}
    listed = "; ".join(f"{name}: steps {steps}" for name, steps in sorted({**seen, **in_buckets}.items()))
    if not aside:
        raise ExistingCheckpointsError(
            f"a fresh start, but the tiers hold an earlier run's checkpoints ({listed}); resume it instead, point "
            f"this run at tiers of its own, or set them aside (start_fresh(set_aside=True): renamed to "
            f"{SET_ASIDE_PREFIX}<time>, never listed or restored)"
        )
    if in_buckets:
        held = "; ".join(f"{name}: steps {steps}" for name, steps in sorted(in_buckets.items()))
        raise ExistingCheckpointsError(
            f"a fresh start, but a bucket holds an earlier run's checkpoints ({held}), which cannot be set aside "
            "(an object store has no rename): point this run at a prefix of its own (the bucket's url), or "
            "delete them (tierstate s3 prune URL --keep-last 0); nothing was set aside"
        )
    label = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    if group is not None:
        label = group.from_leader(label, "fresh start: the set-aside label")
    for tier in tiers:
        mine = group is None or (group.is_node_leader if tier.scope == "node" else group.is_leader)
        if mine:
            set_aside(tier, label)
    if group is not None:
        group.all_gather(None, "fresh start: the old run set aside")
    return seen
