"""Who is uploading a step to a bucket: the object store's counterpart of a directory tier's exclusive
``step-N.partial``.

A bucket has no rename, so a writer uploads its data objects under their final names before its
manifest publishes them. Two writers of one step at the same time (two runs sharing a prefix) would
therefore write objects of the same names, and the loser of the manifest's conditional put could
replace bytes of the checkpoint the winner published. So before its first upload a writer *claims*
the step: ``step-N/upload.json`` (which checkpoint, which host and process, since when), created
only if absent. A claim by the same checkpoint (another node's part, a retry) is shared; a claim
left by a writer killed on this host (its process is gone) is taken over, and so is one left by a
node of the claiming job for an older checkpoint (that job's previous incarnation, re-doing the
step after a crash); any other claim refuses the upload, naming who holds it, until its writer
finishes or ``gc`` removes it after the grace period. A finished upload (published or failed)
releases its claim.
"""

from __future__ import annotations

import errno
import json
import os
import socket
from collections.abc import Collection
from datetime import UTC, datetime

from .filesystem import CheckpointExistsError, TierError
from .nodes import node_name
from .objstore import ObjectMissingError, ObjectStore

CLAIM_NAME = "upload.json"


def _alive_here(claim: dict[str, object]) -> bool:
    """Whether the claim's writer may still be at work: on another host it cannot be told, so yes."""
    pid = claim.get("pid")
    if claim.get("host") != socket.gethostname() or not isinstance(pid, int):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # a process of another user has that pid
    return True


def _superseded(claim: dict[str, object], created: str, nodes: Collection[str]) -> bool:
    """A claim one of ``nodes`` (this job's) left for a checkpoint created before ``created``: this job,
    restarted, checkpoints the step again, so the writer of that claim is gone."""
    held = claim.get("created")
    return claim.get("node") in nodes and isinstance(held, str) and held < created  # ISO times, one format


def claim_step(store: ObjectStore, tier: str, prefix: str, created: str, nodes: Collection[str] = ()) -> None:
    """Claim ``prefix`` (``step-N/``) for the checkpoint created at ``created`` by a job on ``nodes``;
    TierError (EBUSY) naming the holder if another writer holds it."""
    name = prefix + CLAIM_NAME
    mine = {
        "created": created, "host": socket.gethostname(), "node": node_name(), "pid": os.getpid(),
        "since": datetime.now(UTC).isoformat(timespec="seconds"),
    }  # fmt: skip
    for _attempt in range(2):
        try:
            store.put_bytes(name, json.dumps(mine).encode(), if_absent=True)
            return
        except CheckpointExistsError:
            pass
        try:
            held = json.loads(store.get_bytes(name))
        except ObjectMissingError:
            continue  # released meanwhile: try again
        except ValueError:
            held = {}
        if not isinstance(held, dict):
            held = {}
        if held.get("created") == created:
            return  # the same checkpoint: another node's part of it, or this one tried again
        if _alive_here(held) and not _superseded(held, created, nodes):
            who = f"host {held.get('host')}, pid {held.get('pid')}, since {held.get('since')}"
            raise TierError(
                errno.EBUSY,
                f"tier {tier}: {store.where(prefix.rstrip('/'))} is being uploaded by another writer ({who}), "
                f"of a checkpoint created {held.get('created')}; if that writer was killed, gc removes its "
                "claim and objects after the grace period",
            )
        store.delete([name])  # its writer died: taken over
    raise TierError(errno.EBUSY, f"tier {tier}: could not claim {store.where(name)}: another writer keeps taking it")


def release_step(store: ObjectStore, prefix: str) -> None:
    """Drop the claim on ``prefix`` once its upload is over (published, or failed with nothing to finish)."""
    store.delete([prefix + CLAIM_NAME])
