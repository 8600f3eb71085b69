"""The runner's ``kind: s3`` tiers: opened and checked, and published to as the persist tier.

Each bucket is built and checked when the runner is built (:meth:`ObjectStore.check`), so missing or
refused credentials and a missing bucket fail there, naming the tier, and not at the first flush.
A bucket with a ``flush`` policy is a flush target like a directory (pipeline/flush.py, the rule in
tiers/ops/due.py): its copies, receipts, retries and reports are the flusher's.

Restore reads a bucket's copy of a step in place, as the last of a rank's copies (pipeline/agreement.py:
parallel ranged GETs, every frame verified), whether one rank restores or many.

The persist bucket (``config.persist_bucket``: the persist stage names a bucket with ``staging``):
the stage writes and commits each checkpoint in the staging directory, then :meth:`Buckets.publish`
uploads it (verified, data first, the manifest last with the conditional put) before the runner
reports it durable; so a checkpoint is durable exactly when its manifest is in the bucket, and of
two runs writing one step there, one fails naming the step. With many ranks the publication is a
collective after the job's commit: each rank uploads the files it wrote (from the shared staging
directory or its node's), rank 0 puts the global manifest once every rank's uploads succeeded (so
the nodes' parts meet under one prefix, the manifest last), and every rank gets the same outcome.
"""

from __future__ import annotations

import contextlib
import logging

from ..tiers.format.manifest import Manifest
from ..tiers.ops.retention import BucketPolicies, prune_bucket
from ..tiers.storage.filesystem import FilesystemTier
from ..tiers.storage.locks import reading
from ..tiers.storage.nodeparts import files_of_ranks, join_parts
from ..tiers.storage.objstore import ObjectStore
from ..tiers.storage.s3claim import Claim
from ..tiers.storage.s3tier import S3Tier, Written
from .config import PipelineConfig
from .distributed import CheckpointAborted, CheckpointGroup

log = logging.getLogger("tierstate.buckets")


def open_buckets(config: PipelineConfig) -> list[S3Tier]:
    """The buckets of ``config`` (its ``kind: s3`` tiers), each checked now (credentials, the bucket's
    existence), so that a failure names the tier where they are opened, not at their first use."""
    tiers = []
    for name, spec in config.buckets.items():
        retries = spec.flush.retries if spec.flush is not None else 5
        store = ObjectStore(name, spec.url, endpoint_url=spec.endpoint_url, region=spec.region, retries=retries)
        store.check()
        tiers.append(S3Tier(name, store))
    return tiers


class Buckets:
    """The buckets of one runner, and the persist bucket's publication."""

    def __init__(self, config: PipelineConfig) -> None:
        self._persist = config.persist_bucket
        self._tiers = open_buckets(config)
        self._retention = {name: spec.retention for name, spec in config.buckets.items()}

    @property
    def tiers(self) -> list[S3Tier]:
        return list(self._tiers)

    @property
    def persist_bucket(self) -> str | None:
        return self._persist

    def publish(self, step: int, source: FilesystemTier, group: CheckpointGroup | None) -> None:
        """Upload ``step`` from the staging tier ``source`` to the persist bucket, then apply the bucket's
        retention; raises what the upload raised (the checkpoint then fails). With many ranks, a collective:
        see :meth:`_publish_ranks`."""
        (bucket,) = [b for b in self._tiers if b.name == self._persist]
        if group is not None:
            self._publish_ranks(bucket, step, source, group)
        else:
            with reading(source.step_dir(step)):
                bucket.upload(source.step_dir(step), source.manifest(step))
            self._retain(bucket)
        log.info("checkpoint step %d published in %s", step, bucket.store.where())

    def _publish_ranks(self, bucket: S3Tier, step: int, source: FilesystemTier, group: CheckpointGroup) -> None:
        """Rank 0 claims the step in the bucket; then every rank uploads the files it wrote (from the shared
        staging directory, or from its node's), each verified first; once every rank says its uploads
        succeeded, rank 0 puts the global manifest (on a node-scoped staging tier, joined from the node
        leaders' parts) with the conditional put and applies retention. Every rank gets the same outcome,
        so no rank reports the step durable before the bucket publishes it, and all fail together, naming
        the rank and the reason, if the claim, any rank's upload or the publication fails."""
        where = f"bucket {bucket.name}"
        error = refused = None
        seen: Manifest | None = None
        claim: Claim | None = None
        written: dict[str, Written] = {}
        with contextlib.ExitStack() as held:
            try:  # every rank reaches every collective below, whatever fails on it
                held.enter_context(reading(source.step_dir(step)))
                seen = source.manifest(step)  # the whole checkpoint, or this node's part of it: one checkpoint id
                if group.is_leader:
                    claim = bucket.claim(seen, list(group.nodes))
            except Exception as exc:  # told to every rank, which all fail the step with it
                error = f"rank {group.rank}: {type(exc).__name__}: {exc}"
            refused = group.from_leader(error if group.is_leader else None, f"step {step}: claiming it in {where}")
            if refused is not None:
                raise CheckpointAborted(f"step {step} was not published in {where}: {refused}")
            if seen is not None and error is None:
                try:
                    written = bucket.upload_files(source.step_dir(step), files_of_ranks(seen, [group.rank]))
                except Exception as exc:  # told to every rank, which all fail the step with it
                    error = f"rank {group.rank}: {type(exc).__name__}: {exc}"
        whole_or_part = seen is not None and (group.is_leader if seen.node_part is None else group.is_node_leader)
        part = seen if whole_or_part else None  # what rank 0 needs to write the global manifest
        said = group.gather_to_leader((error, part, written), f"step {step}: uploading to {where}")
        outcome = self._publish_whole(bucket, step, said, claim) if said is not None else None
        outcome = group.from_leader(outcome, f"step {step}: publishing in {where}")
        if outcome is not None:
            raise CheckpointAborted(f"step {step} was not published in {where}: {outcome}")

    def _publish_whole(
        self, bucket: S3Tier, step: int, said: list[tuple[str | None, Manifest | None, dict[str, Written]]],
        claim: Claim | None,
    ) -> str | None:
        """On rank 0, once every rank said how its uploads went (and what each uploaded): the global manifest
        put last (joined from the node parts on a node-scoped staging tier) once every object is checked to
        be the one its rank uploaded, then retention, then the claim released; what went wrong, or None.
        Never raises: the other ranks wait for its answer."""
        errors = [error for error, _part, _written in said if error is not None]
        parts = [part for _error, part, _written in said if part is not None]
        written = {name: object_ for _error, _part, each in said for name, object_ in each.items()}
        try:
            if not errors:
                whole = join_parts(step, parts) if parts[0].node_part is not None else parts[0]
                bucket.publish(whole, written)
                self._retain(bucket)
        except Exception as exc:  # every rank fails the step with it
            errors.append(f"rank 0 could not publish the manifest: {type(exc).__name__}: {exc}")
        try:
            if claim is not None:
                bucket.release_claim(claim)  # every rank's uploads are over, whatever the outcome
        except Exception as exc:  # a claim left behind only delays a later writer until gc
            log.warning("step %d: could not release its claim in bucket %s: %s", step, bucket.name, exc)
        return "; ".join(errors) or None

    def _retain(self, bucket: S3Tier) -> None:
        prune_bucket(BucketPolicies(bucket, self._retention[bucket.name]), dry_run=False)
