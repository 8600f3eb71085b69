"""Who is uploading a step to a bucket: the object store's counterpart of a directory tier's exclusive
``step-N.partial``.

A bucket has no rename, so a writer uploads its data objects under their final names before its
manifest publishes them. Two writers of one step at the same time (two runs sharing a prefix) would
therefore write objects of the same names, and the loser of the manifest's conditional put could
replace bytes of the checkpoint the winner published. So before its first upload a writer *claims*
the step: ``step-N/upload.json`` (which checkpoint by its random id, which host and process, since
when), created only if absent (``If-None-Match: *``). A claim of the same checkpoint id (another
node's part of it, a retry) is shared; two checkpoints never share one, however close their creation
times. A claim left by a writer killed on this host (its process is gone, or its pid now belongs to
a process started later) is taken over, and so is one left by a node of the claiming job for an
older checkpoint (that job's previous incarnation, re-doing the step after a crash). A takeover is
itself conditional: the claim read is replaced only while its ETag is still the one read
(``If-Match``), so of two writers taking over one stale claim exactly one succeeds and the other
looks again, finding the winner's live claim. Any other claim refuses the upload, naming who holds
it, until its writer finishes or ``gc`` removes it (see :func:`claim_is_live`). A finished upload
(published or failed) releases its claim, again only while it is the one it took (``If-Match``), so a
writer never removes a claim another writer has since taken over.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..format.manifest import Manifest
from .filesystem import CheckpointExistsError, TierError
from .nodes import node_name
from .objstore import ObjectChangedError, ObjectMissingError, ObjectStore

CLAIM_NAME = "upload.json"
_ATTEMPTS = 5  # each attempt after the first follows a change another writer made to the claim meanwhile


@dataclass(frozen=True)
class Claim:
    """A claim this writer holds or shares: the claim object, its ETag when taken, and the checkpoint's id."""

    name: str
    etag: str
    checkpoint: str


def claim_key(manifest: Manifest) -> str:
    """What a claim names the checkpoint by: its id; for a manifest written before ids, its creation time
    (as claims did then)."""
    return manifest.checkpoint_id or f"created {manifest.created}"


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, from /proc), or None if it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        return int(stat[stat.rindex(b")") + 2 :].split()[19])  # field 22; the name before it may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def _writer() -> dict[str, Any]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "node": node_name(), "pid": pid, "started": _started(pid)}


def parse_claim(raw: bytes) -> dict[str, Any]:
    """A claim's fields; an unreadable claim is an empty one (whose writer cannot be told dead)."""
    try:
        held = json.loads(raw)
    except ValueError:
        return {}
    return held if isinstance(held, dict) else {}


def alive_here(claim: dict[str, Any]) -> bool | None:
    """Whether the claim's writer runs on this host (True/False), or None when that cannot be told here
    (another host, an unreadable claim). A pid that exists but started after the claim's writer did is
    another process, so the writer is gone."""
    pid = claim.get("pid")
    if claim.get("host") != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # a process of another user has that pid: told apart by its start time below
    started = claim.get("started")
    return not (isinstance(started, int) and _started(pid) not in (None, started))


def claim_is_live(claim: dict[str, Any], age_s: float, grace_s: float) -> bool:
    """Whether the upload under a claim may still be at work, as gc judges it: its writer runs on this host,
    or, where that cannot be told (another host), the claim was written less than ``grace_s`` ago (the
    server's clock, ``age_s``)."""
    here = alive_here(claim)
    return here if here is not None else age_s < grace_s


def _superseded(claim: dict[str, Any], created: str, nodes: Collection[str]) -> bool:
    """A claim one of ``nodes`` (this job's) left for a checkpoint created before ``created``: this job,
    restarted, checkpoints the step again, so the writer of that claim is gone."""
    held = claim.get("created")
    return claim.get("node") in nodes and isinstance(held, str) and held < created  # ISO times, one format


def claim_step(
    store: ObjectStore, tier: str, prefix: str, checkpoint: str, created: str, nodes: Collection[str] = ()
) -> Claim:
    """Claim ``prefix`` (``step-N/``) for checkpoint ``checkpoint`` (its id, see :func:`claim_key`) created
    at ``created`` by a job on ``nodes``; the claim held or shared. TierError (EBUSY) naming the holder if
    another writer holds it."""
    name = prefix + CLAIM_NAME
    since = datetime.now(UTC).isoformat(timespec="seconds")
    mine = json.dumps({"checkpoint": checkpoint, "created": created, **_writer(), "since": since}).encode()
    for _attempt in range(_ATTEMPTS):
        try:
            return Claim(name, store.put_bytes(name, mine, if_absent=True), checkpoint)
        except CheckpointExistsError:
            pass
        try:
            raw, etag = store.get_versioned(name)
        except ObjectMissingError:
            continue  # released meanwhile: try again
        held = parse_claim(raw)
        if held.get("checkpoint") == checkpoint:
            return Claim(name, etag, checkpoint)  # the same checkpoint: another node's part of it, or a retry
        if alive_here(held) is not False and not _superseded(held, created, nodes):
            who = f"host {held.get('host')}, pid {held.get('pid')}, since {held.get('since')}"
            raise TierError(
                errno.EBUSY,
                f"tier {tier}: {store.where(prefix.rstrip('/'))} is being uploaded by another writer ({who}), "
                f"of checkpoint {held.get('checkpoint')} created {held.get('created')}; if that writer was "
                "killed, gc removes its claim and objects after the grace period",
            )
        try:  # its writer is gone: taken over, only if no other writer took it over first
            return Claim(name, store.put_bytes(name, mine, if_match=etag), checkpoint)
        except (ObjectChangedError, ObjectMissingError):
            continue  # another writer took it over or released it: look again
    raise TierError(errno.EBUSY, f"tier {tier}: could not claim {store.where(name)}: other writers keep changing it")


def release_step(store: ObjectStore, claim: Claim) -> None:
    """Drop ``claim`` once its upload is over (published, or failed with nothing to finish), unless another
    writer has since taken it over (then it is theirs, and stays)."""
    store.delete_if(claim.name, claim.etag)
