"""A tier that is an S3 bucket prefix: the commit protocol of DESIGN.md without a rename.

Layout: ``<prefix>/step-N/<file>`` holds a checkpoint's data files and indexes under the names they
have on a file system tier, and ``<prefix>/step-N/manifest.json`` publishes it. Object stores have
no rename, so the commit is the order of writes: every data object and index first (large ones as
multipart uploads, each part CRC32-checked by the server), the manifest last with a conditional put
(``If-None-Match: *``). A prefix without its manifest is not a checkpoint, whatever else it holds,
and of two writers publishing the same step exactly one succeeds; the other gets a
CheckpointExistsError naming the tier. Before its first upload a writer claims the step
(tiers/storage/s3claim.py), so two writers never upload objects of one step at once. The nodes of a
multi-node job each upload their part with a marker object, and the last one publishes the global
manifest (:meth:`S3Tier.upload` of a part).

Every frame is verified in its source before a byte of it is uploaded, and every frame downloaded
is verified before the copy is committed on the local tier, so the bucket never publishes what the
source could not prove, and restore never takes a damaged object: it fails naming it, and the
restore path falls back to the next copy as for any tier.

Before the manifest's conditional put the publisher lists the step and checks that every object the
manifest names is there with the size it has and, for each object this publisher uploaded, the ETag
the upload answered (the server's digest: an object rewritten since, by another writer or after a gc,
has another), so it never publishes a step whose objects are not the ones it wrote.

A writer killed mid-checkpoint leaves objects without a manifest, its claim and, mid-upload, an
incomplete multipart upload (billed, invisible to listings). gc (tiers/storage/s3gc.py) judges
each step by its claim, never by each object's age alone: nothing of an upload whose claim is live
is removed (tiers/storage/s3claim.py, :func:`~tiers.storage.s3claim.claim_is_live`), and the rest goes once its
newest object or uploaded part is older than the grace period.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Collection, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from ..format.format import manifest_bytes, parse_manifest
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.names import STEP_PREFIX, step_name
from ..reading.integrity import verify_source
from ..reading.reader import CorruptCheckpointError
from ..reading.source import ShortReadError
from .filesystem import CheckpointExistsError, FilesystemTier, InvalidEntry, Scope, TierError
from .nodeparts import PART_MARKER_PREFIX, join_parts, part_marker, part_of_marker
from .objstore import ObjectMissingError, ObjectStore, Progress
from .s3claim import Claim, claim_key, claim_step, release_step
from .s3gc import Leftover, collect_garbage, committed_steps, step_of_object
from .safeopen import open_or_create, open_read


@dataclass(frozen=True)
class Written:
    """An object as its upload left it: its size and the ETag the server answered."""

    size: int
    etag: str


@dataclass
class TransferReport:
    step: int
    source: str
    target: str
    outcome: str  # "copied" or "already there"
    files: int = 0
    bytes: int = 0
    written: dict[str, Written] = field(default_factory=dict, repr=False)  # by file name, what was uploaded
    waiting_for: list[str] = field(default_factory=list)  # a node's part: nodes whose parts are not there yet


class BucketSource:
    """One checkpoint's prefix (``step-N/``) as a :class:`~tiers.reading.source.ByteSource`: restore, verify,
    inspect and export read a bucket through the code that reads a directory, every frame verified
    there. Sizes come from one listing; each ``read_into`` is one ranged GET (callers run them in
    parallel: the store's client is thread-safe)."""

    def __init__(self, store: ObjectStore, prefix: str) -> None:
        self.store = store
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self._sizes: dict[str, int] | None = None

    @property
    def where(self) -> str:
        return self.store.where(self.prefix.rstrip("/"))

    def __repr__(self) -> str:
        return f"BucketSource({self.where})"

    def __str__(self) -> str:  # in messages, as a directory's path is
        return self.where

    def _listing(self) -> dict[str, int]:
        if self._sizes is None:
            cut = len(self.prefix)
            objects = self.store.list(self.prefix)
            self._sizes = {o.name[cut:]: o.size for o in objects if "/" not in o.name[cut:]}
        return self._sizes

    def names(self) -> list[str]:
        return list(self._listing())

    def size(self, name: str) -> int:
        sizes = self._listing()
        if name not in sizes:
            raise ObjectMissingError(errno.ENOENT, f"{self.where}/{name}: no such object")
        return sizes[name]

    def read_into(self, name: str, offset: int, buffer: memoryview) -> None:
        end = offset + len(buffer)
        if end > self.size(name):
            raise ShortReadError(errno.EIO, f"{self.where}/{name}: ends at byte {self.size(name)}, short of {end}")
        buffer[:] = self.store.get_range(self.prefix + name, offset, len(buffer))

    def read_small(self, name: str) -> bytes:
        return self.store.get_bytes(self.prefix + name)

    @property
    def local_directory(self) -> None:
        return None  # objects in a bucket: read through ranged GETs only

    def reading(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()  # nothing to lock: a prefix is published by its manifest object


@dataclass
class S3Tier:
    """A shared tier in one bucket prefix; ``store`` does the talking (see :mod:`tiers.storage.objstore`)."""

    name: str
    store: ObjectStore
    scope: Scope = field(default="shared", init=False)

    def where(self, step: int | None = None) -> str:
        """For messages: the prefix's ``s3://`` URL, or ``step``'s under it."""
        return self.store.where() if step is None else self.store.where(step_name(step))

    def as_directory(self) -> None:
        return None

    def as_bucket(self) -> S3Tier:
        return self

    def invalid(self) -> list[InvalidEntry]:
        """Entries named like checkpoints that are none: a bucket has no such directories (a prefix without its
        manifest is an upload in progress or left by a killed one, gc's business: :meth:`incomplete_steps`)."""
        return []

    def step_prefix(self, step: int) -> str:
        return f"{step_name(step)}/"

    def steps(self) -> list[int]:
        """Committed steps: those whose manifest object exists."""
        return sorted(committed_steps(self.store.list(STEP_PREFIX)))

    def source(self, step: int) -> BucketSource:
        """``step-N`` as a byte source, for :class:`tiers.reading.stored.StoredCheckpoint` to read."""
        return BucketSource(self.store, self.step_prefix(step))

    def location(self, step: int) -> BucketSource:
        """Where ``step`` is, as a directory tier's ``location`` says it: here its byte source."""
        return self.source(step)

    def manifest(self, step: int) -> Manifest:
        name = self.step_prefix(step) + MANIFEST_NAME
        return parse_manifest(self.store.get_bytes(name), self.store.where(name))

    # -- writing --------------------------------------------------------------------------------
    def upload(self, source: Path, manifest: Manifest, progress: Progress | None = None) -> TransferReport:
        """Publish the committed checkpoint in directory ``source`` (described by ``manifest``) as
        ``step-N`` here: verified first, data and indexes uploaded, then checked in the bucket and the
        manifest put last and conditional. A node's part (``manifest.node_part``) is uploaded as its share
        of the step (see below)."""
        step = manifest.step
        report = TransferReport(step, str(source), self.store.where(step_name(step)), "copied")
        if self._holds_it(source, manifest):
            report.outcome = "already there"
            return report
        own = manifest.node_part
        try:
            claim = self.claim(manifest, own.nodes if own is not None else ())
        except TierError as exc:  # published meanwhile: by another writer of this very checkpoint, it is received
            if exc.errno == errno.EEXIST and self._holds_it(source, manifest):
                report.outcome = "already there"
                return report
            raise
        if own is not None:  # the claim is the step's, shared by its nodes and released by the one that publishes
            self._upload_into(report, source, manifest, progress)
            self.store.put_bytes(self.step_prefix(step) + part_marker(own.node), manifest_bytes(manifest))
            report.waiting_for = self._publish_when_whole(step, own.nodes, claim, report.written)
            return report
        try:
            self._upload_into(report, source, manifest, progress)
            self.publish(manifest, report.written)
        except CheckpointExistsError:  # another writer of the same checkpoint (a migrate, a push) came first
            if not self._holds_it(source, manifest):
                raise
            report.outcome = "already there"
        finally:
            self.release_claim(claim)
        return report

    def _upload_into(self, report: TransferReport, source: Path, manifest: Manifest, progress: Progress | None) -> None:
        report.written = self.upload_files(source, manifest, progress)
        report.files, report.bytes = len(report.written), sum(w.size for w in report.written.values())

    def _holds_it(self, source: Path, manifest: Manifest) -> bool:
        """Whether ``step-N`` here is already the checkpoint ``manifest`` describes (for a node's part: the
        same checkpoint, holding the part's files); TierError if it is another one."""
        step = manifest.step
        if not self.holds(step):
            return False
        existing = self.manifest(step)
        if manifest.node_part is None:
            same = manifest_bytes(existing) == manifest_bytes(manifest)
        else:
            mine = manifest.files.items()
            same = existing.same_checkpoint(manifest) and all(existing.files.get(n) == r for n, r in mine)
        if not same:
            raise TierError(
                errno.EEXIST,
                f"tier {self.name} already holds a different checkpoint for step {step} "
                f"(created {existing.created}; the one in {source} was created {manifest.created})",
            )
        return True

    def _publish_when_whole(
        self, step: int, nodes: list[str], claim: Claim, written: Mapping[str, Written]
    ) -> list[str]:
        """A node's part of a multi-node checkpoint is in (its files, then its marker
        ``step-N/node-<name>.part``, the part's manifest): publish ``step`` if every node's marker is
        here, else leave it to the last node. So the parts meet under one prefix with no collective among
        the nodes, as on a shared directory tier (tiers/storage/nodeparts.py): each node writes its marker before
        it looks, and listings are strongly consistent, so the last node to finish sees them all; two
        nodes publishing together put the same manifest, and the one that loses the conditional put finds
        it there. The publishing node checks its own objects by their ETags, the other nodes' by size.
        Returns the nodes whose parts are not here yet (none once published)."""
        prefix = self.step_prefix(step)
        markers = [part_marker(node) for node in nodes]
        listed = {o.name for o in self.store.list(prefix + PART_MARKER_PREFIX)}
        missing = [node for node, marker in zip(nodes, markers, strict=True) if prefix + marker not in listed]
        if missing:
            return missing
        read = [(marker, self.store.get_bytes(prefix + marker)) for marker in markers]
        whole = join_parts(step, [part_of_marker(data, m, step, self.store.where(prefix + m)) for m, data in read])
        try:
            self.publish(whole, written)
        except CheckpointExistsError:
            if manifest_bytes(self.manifest(step)) != manifest_bytes(whole):
                raise
        self.release_claim(claim)
        return []

    def claim(self, manifest: Manifest, nodes: Collection[str] = ()) -> Claim:
        """Claim ``step-N`` for the checkpoint ``manifest`` describes (made by a job on ``nodes``) before
        uploading a byte of it (tiers/storage/s3claim.py); TierError if another writer holds the claim or the step
        is already published (checked after claiming: a writer publishes before it releases its claim)."""
        step = manifest.step
        claim = claim_step(self.store, self.name, self.step_prefix(step), claim_key(manifest), manifest.created, nodes)
        if self.holds(step):
            self.release_claim(claim)
            raise TierError(errno.EEXIST, f"tier {self.name} already holds step {step}")
        return claim

    def release_claim(self, claim: Claim) -> None:
        """Drop ``claim``: its upload is over (published, or failed). A claim another writer took over since
        is theirs and stays."""
        release_step(self.store, claim)

    def holds(self, step: int) -> bool:
        """Whether ``step`` is committed here (its manifest object exists): one small listing."""
        name = self.step_prefix(step) + MANIFEST_NAME
        return any(o.name == name for o in self.store.list(name))

    def upload_files(self, source: Path, manifest: Manifest, progress: Progress | None = None) -> dict[str, Written]:
        """Upload the data files and indexes ``manifest`` lists (a whole checkpoint, one node's part or one
        rank's files) from ``source`` under ``step-N/``, each verified in the source first; nothing is
        published. Returns what went up, by file name."""
        step = manifest.step
        problems = verify_source(source, manifest)
        if problems:
            raise CorruptCheckpointError(f"{source}: {problems[0]}; not uploading it to tier {self.name}")
        written: dict[str, Written] = {}
        for name in sorted(manifest.indexes) + sorted(manifest.files):
            fd = open_read(source / name)
            try:
                size = os.fstat(fd).st_size
                written[name] = Written(size, self.store.put_file(self.step_prefix(step) + name, fd, size, progress))
            finally:
                os.close(fd)
        return written

    def check_uploaded(self, manifest: Manifest, written: Mapping[str, Written]) -> None:
        """Before ``manifest`` is put: every data file and index it lists is under ``step-N/`` with the size
        the manifest gives it, and each object this writer uploaded (``written``) still has the size and
        ETag its upload answered; TierError naming the first that is not (removed, or rewritten by another
        writer), so a step is never published over objects that are not the ones written for it."""
        prefix = self.step_prefix(manifest.step)
        listed = {o.name[len(prefix) :]: o for o in self.store.list(prefix)}
        for name in sorted(manifest.files) + sorted(manifest.indexes):
            found, mine = listed.get(name), written.get(name)
            size = manifest.files[name].size if name in manifest.files else mine.size if mine is not None else None
            if found is None:
                problem = "is missing"
            elif size is not None and found.size != size:
                problem = f"is {found.size} bytes, {size} were written"
            elif mine is not None and found.etag != mine.etag:
                problem = f"is not the object uploaded (ETag {found.etag}, not {mine.etag})"
            else:
                continue
            raise TierError(
                errno.EIO,
                f"tier {self.name}: not publishing step {manifest.step}: {self.store.where(prefix + name)} "
                f"{problem}; another writer or a gc changed it after its upload",
            )

    def publish(self, manifest: Manifest, written: Mapping[str, Written]) -> None:
        """Make ``step-N`` a checkpoint once :meth:`check_uploaded` passes: its manifest object, put only if
        absent (of two writers of one step exactly one succeeds; the other gets CheckpointExistsError naming
        the tier)."""
        if manifest.node_part is not None:
            raise TierError(errno.EOPNOTSUPP, f"tier {self.name}: a node's part is never published as a checkpoint")
        self.check_uploaded(manifest, written)
        self.store.put_bytes(self.step_prefix(manifest.step) + MANIFEST_NAME, manifest_bytes(manifest), if_absent=True)

    # -- reading --------------------------------------------------------------------------------
    def download(self, step: int, target: FilesystemTier, progress: Progress | None = None) -> TransferReport:
        """Copy ``step-N`` to file system tier ``target`` with parallel ranged GETs, verify every frame
        and index there, and only then commit it; a damaged object fails naming it and commits nothing."""
        manifest = self.manifest(step)
        report = TransferReport(step, self.store.where(step_name(step)), str(target.step_dir(step)), "copied")
        if step in target.steps():
            report.outcome = "already there"
            return report
        partial = target.begin(step)
        try:
            sizes = {n: r.size for n, r in manifest.files.items()}
            listed = {o.name: o.size for o in self.store.list(self.step_prefix(step))}
            for name in sorted(manifest.indexes) + sorted(manifest.files):
                key = self.step_prefix(step) + name
                if key not in listed:
                    where = self.store.where(key)
                    raise CorruptCheckpointError(f"{where} is missing (step {step} on tier {self.name})")
                size = listed[key]
                if name in sizes and size != sizes[name]:
                    raise CorruptCheckpointError(
                        f"{self.store.where(key)} is {size} bytes, the manifest says {sizes[name]}"
                    )
                fd = open_or_create(partial / name)
                try:
                    self.store.get_file(key, fd, size, progress)
                finally:
                    os.close(fd)
                report.files += 1
                report.bytes += size
            problems = verify_source(partial, manifest)
            if problems:
                raise CorruptCheckpointError(
                    f"{self.store.where(self.step_prefix(step) + problems[0].file)}: {problems[0]} "
                    f"(step {step} on tier {self.name})"
                )
            target.commit(step, manifest)
        except BaseException:
            target.abort(step)
            raise
        return report

    # -- deleting -------------------------------------------------------------------------------
    def delete_step(self, step: int) -> None:
        """The manifest first (the step stops being a checkpoint at once), then everything under it."""
        prefix = self.step_prefix(step)
        self.store.delete([prefix + MANIFEST_NAME])
        self.store.delete([o.name for o in self.store.list(prefix)])

    def step_bytes(self) -> dict[int, tuple[int, datetime]]:
        """Per step with objects under its prefix: their total size and the newest one's time (one listing)."""
        found: dict[int, tuple[int, datetime]] = {}
        for obj in self.store.list(STEP_PREFIX):
            step = step_of_object(obj.name)
            if step is not None:
                size, newest = found.get(step, (0, obj.modified))
                found[step] = (size + obj.size, max(newest, obj.modified))
        return found

    def incomplete_steps(self) -> set[int]:
        """Steps with objects under their prefix and no manifest: not checkpoints (a writer at work, or
        one that was killed)."""
        objects = self.store.list(STEP_PREFIX)
        return {step for o in objects if (step := step_of_object(o.name)) is not None} - committed_steps(objects)

    def collect_garbage(self, older_than: float, dry_run: bool = False) -> list[Leftover]:
        """Remove what killed writers left under the prefix, judged step by step by each step's claim
        (:func:`tiers.storage.s3gc.collect_garbage`); what was found and done."""
        return collect_garbage(self.store, older_than, dry_run)
