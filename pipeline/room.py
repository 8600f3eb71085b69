"""Room on a tier whose size is bounded (``tiers.NAME.size``; a memory tier must have one).

A memory tier lives in the node's RAM, which the training job needs too, so what it holds is
bounded. With ``retention: {keep_last: K}`` it holds the K newest committed checkpoints plus the
one being written: before a checkpoint writes its files there, it reserves room for them. If the
tier is too full, older copies are still on their way to the slower tiers (retention keeps a copy
until every flush tier due to receive it has it), so the job waits for those flushes and the
pruning after them, on the runner's loop (the trainer is not held up unless it asks for the next
checkpoint meanwhile, as ``policies.in_flight: wait`` always does). A tier that cannot hold K + 1
checkpoints of this size fails the checkpoint at once, naming the key to change: no wait could
make room there.

With ``replicas: 1`` the tier also keeps the partner node's parts (pipeline/peers.py), as many as its own,
and a part arriving from the partner is refused when it does not fit (:func:`no_room_for`).

The bytes of a checkpoint on a node are estimated as this rank's share times the node's rank count
(the ranks' shares are balanced by bytes, see pipeline/assign.py); what is in the tier is measured
(allocated blocks of every step and partial directory), so other ranks' files count as they land.
"""

from __future__ import annotations

import concurrent.futures
import errno
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pydantic import ByteSize

from ..tiers.storage.filesystem import FilesystemTier, TierError
from .config_schema import TierConfig
from .units import run_blocking

# Objects (serialized Python values) and indexes are not in the plan's tensor bytes: a margin for them.
_METADATA_MARGIN = 1 << 20


class TierFullError(TierError):
    """A checkpoint does not fit on a tier whose size is bounded; names the ``tiers.NAME.size`` key."""


def _human(nbytes: int) -> str:
    return ByteSize(nbytes).human_readable()


@dataclass
class Room:
    """Reserves room for one rank's files of a checkpoint on ``tier``, bounded by ``config.size``.

    ``settle``: waits until one pending flush or prune is done (with none pending, prunes once);
    says whether anything happened that may have freed room.
    """

    tier: FilesystemTier
    config: TierConfig
    node_ranks: int
    settle: Callable[[], Awaitable[bool]]
    pool: concurrent.futures.Executor
    size: int  # ``config.size``, which a Room is made only for: see :meth:`of`

    @classmethod
    def of(
        cls,
        tier: FilesystemTier,
        config: TierConfig,
        node_ranks: int,
        settle: Callable[[], Awaitable[bool]],
        pool: concurrent.futures.Executor,
    ) -> Room | None:
        """The room of ``tier`` when its size is bounded; None when it is not (nothing to reserve)."""
        return None if config.size is None else cls(tier, config, node_ranks, settle, pool, int(config.size))

    def needed(self, step: int, rank_bytes: int) -> int:
        """This node's bytes of ``step``; TierFullError if the tier cannot hold keep_last + 1 of them."""
        need = (rank_bytes + _METADATA_MARGIN) * self.node_ranks
        keep = self.config.retention.keep_last or 1
        copies = 1 + self.config.replicas  # with replicas: 1 it also keeps the partner node's part, as many
        if need * (keep + 1) * copies > self.size:
            kept = f"{keep} checkpoint(s) plus the one being written"
            if self.config.replicas:
                kept += ", and as many of the partner node's parts (replicas: 1)"
            raise TierFullError(
                errno.ENOSPC,
                f"tiers.{self.tier.name}.size: {_human(self.size)} cannot hold this job's checkpoints: step {step} "
                f"takes about {_human(need)} on this node, and with retention keep_last={keep} the tier holds {kept}, "
                f"{_human(need * (keep + 1) * copies)}; raise size (or lower keep_last)",
            )
        return need

    async def reserve(self, step: int, rank_bytes: int, reused: Callable[[], int] | None = None) -> None:
        """Return once this node's files of ``step`` fit beside what the tier holds; TierFullError if
        they never will (nothing pending that could free room). ``reused``: the bytes of this rank's files
        the tier holds already and the checkpoint takes over (a memory tier's free slot), not counted twice."""
        need = self.needed(step, rank_bytes)

        def taken() -> int:  # one trip to the pool's thread: each wakes a thread that takes the GIL from the trainer
            used = self.tier.bytes_used()
            return used if reused is None else used - min(reused() * self.node_ranks, need)

        while True:
            used = await run_blocking(self.pool, taken)
            if used + need <= self.size:
                return
            if not await self.settle():
                held = await run_blocking(self.pool, self.tier.steps)
                raise TierFullError(
                    errno.ENOSPC,
                    f"tier {self.tier.name}: step {step} needs about {_human(need)}, but {_human(used)} of its "
                    f"{_human(self.size)} (tiers.{self.tier.name}.size) are taken by steps {held} and leftovers, "
                    "which retention does not free; raise size, lower keep_last, or run tierstate gc",
                )


def no_room_for(tier: FilesystemTier, config: TierConfig, nbytes: int, what: str) -> str | None:
    """Why ``what`` (``nbytes`` arriving on ``tier``, a partner node's part) cannot be kept there beside what
    the tier holds; None when it fits or the tier is unbounded. Nothing waits: the partner's next part
    comes with its next checkpoint, and the tier's own checkpoints must not wait behind a copy."""
    if config.size is None:
        return None
    used = tier.bytes_used()
    if used + nbytes <= config.size:
        return None
    return (
        f"tier {tier.name}: no room for {what} ({_human(nbytes)}): {_human(used)} of its {_human(int(config.size))} "
        f"(tiers.{tier.name}.size) are taken; raise size"
    )
