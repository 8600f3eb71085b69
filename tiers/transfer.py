"""Copying a committed checkpoint from one tier to another, whichever kind each is.

Between two directory tiers it is :func:`tiers.migrate.migrate` (frame by frame, resumable, verified
on the target, published by rename). To a bucket it is :meth:`S3Tier.upload` (every frame verified in
the source first, data uploaded, the manifest last with a conditional put), the source copy read-locked
meanwhile so retention cannot delete it mid-read; from a bucket, :meth:`S3Tier.download` (every frame
verified before the local commit). Each returns one :class:`~tiers.migrate.MigrateReport`, so the
runner's flushes, ``tierstate flush`` and ``tierstate migrate`` report a bucket like a directory.
"""

from __future__ import annotations

import errno
import time

from .container import Format
from .filesystem import FilesystemTier, TierError
from .locks import reading
from .migrate import MigrateReport, Progress, migrate, paced
from .pacing import Pacer
from .retention import delete_step
from .s3tier import S3Tier, TransferReport

AnyTier = FilesystemTier | S3Tier


def transfer(
    step: int,
    source: AnyTier,
    target: AnyTier,
    *,
    move: bool = False,
    fmt: Format | None = None,
    align: int = 4096,
    pacer: Pacer | None = None,
    progress: Progress | None = None,
) -> MigrateReport:
    """Copy (``move``: then delete from ``source``) committed checkpoint ``step`` to ``target``; ``fmt``
    rewrites it between two directory tiers (a bucket takes and gives checkpoints as they are)."""
    if isinstance(source, FilesystemTier) and isinstance(target, FilesystemTier):
        return migrate(step, source, target, move=move, fmt=fmt, align=align, pacer=pacer, progress=progress)
    if fmt is not None:
        raise TierError(
            errno.EOPNOTSUPP, "a bucket takes and gives checkpoints as they are; convert on a directory tier"
        )
    return _bucket_copy(step, source, target, move=move, pacer=pacer, progress=progress)


def _bucket_copy(
    step: int,
    source: AnyTier,
    target: AnyTier,
    *,
    move: bool,
    pacer: Pacer | None,
    progress: Progress | None,
) -> MigrateReport:
    """Between a directory tier and a bucket, either way; every frame verified on the way."""
    started = time.perf_counter()
    advance = paced(progress, pacer)
    if isinstance(target, S3Tier) and isinstance(source, FilesystemTier):
        with reading(source.step_dir(step)):
            manifest = source.manifest(step)
            sent: TransferReport = target.upload(source.step_dir(step), manifest, advance)
    elif isinstance(source, S3Tier) and isinstance(target, FilesystemTier):
        manifest = source.manifest(step)
        sent = source.download(step, target, advance)
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
        if isinstance(source, S3Tier):
            source.delete_step(step)
        else:
            delete_step(source, step)
        report.moved = True
    report.seconds = time.perf_counter() - started
    return report
