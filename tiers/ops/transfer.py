"""Copying a committed checkpoint from one tier to another, whichever kind each is.

Between two directory tiers it is :func:`tiers.ops.migrate.migrate` (frame by frame, resumable, verified
on the target, published by rename). To a bucket it is :meth:`S3Tier.upload` (every frame verified in
the source first, data uploaded, the manifest last with a conditional put), the source copy read-locked
meanwhile so retention cannot delete it mid-read; from a bucket, :meth:`S3Tier.download` (every frame
verified before the local commit). Each returns one :class:`~tiers.ops.migrate.MigrateReport`, so the
runner's flushes, ``tierstate flush`` and ``tierstate migrate`` report a bucket like a directory.
"""

from __future__ import annotations

import errno
import time

from ..format.container import Format
from ..storage.filesystem import TierError
from ..storage.locks import reading
from ..storage.s3tier import TransferReport
from ..storage.tier import Tier
from .migrate import MigrateReport, Progress, migrate, paced
from .pacing import Pacer


def transfer(
    step: int,
    source: Tier,
    target: Tier,
    *,
    move: bool = False,
    fmt: Format | None = None,
    align: int = 4096,
    pacer: Pacer | None = None,
    progress: Progress | None = None,
) -> MigrateReport:
    """Copy (``move``: then delete from ``source``) committed checkpoint ``step`` to ``target``; ``fmt``
    rewrites it between two directory tiers (a bucket takes and gives checkpoints as they are)."""
    here, there = source.as_directory(), target.as_directory()
    if here is not None and there is not None:
        return migrate(step, here, there, move=move, fmt=fmt, align=align, pacer=pacer, progress=progress)
    if fmt is not None:
        raise TierError(
            errno.EOPNOTSUPP, "a bucket takes and gives checkpoints as they are; convert on a directory tier"
        )
    started = time.perf_counter()
    advance = paced(progress, pacer)
    bucket = target.as_bucket()
    if here is not None and bucket is not None:
        with reading(here.step_dir(step)):
            manifest = here.manifest(step)
            sent: TransferReport = bucket.upload(here.step_dir(step), manifest, advance)
    elif (bucket := source.as_bucket()) is not None and there is not None:
        manifest = bucket.manifest(step)
        sent = bucket.download(step, there, advance)
    else:
        raise TierError(errno.EOPNOTSUPP, f"step {step}: {source.name} -> {target.name}: both are buckets; "
                        "migrate through a directory tier")  # fmt: skip
    frames = sum(len(record.frames) for record in manifest.files.values())
    copied = sent.outcome == "copied"
    report = MigrateReport(
        step, source.name, target.name, sent.target, sent.outcome, frames,
        frames_copied=frames if copied else 0, frames_reused=0 if copied else frames,
        bytes_copied=sent.bytes, bytes_reused=0 if copied else manifest.stored_bytes,
        waiting_for=list(sent.waiting_for),
    )  # fmt: skip
    if move:
        source.delete_step(step)
        report.moved = True
    report.seconds = time.perf_counter() - started
    return report
