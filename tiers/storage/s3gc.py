"""What a bucket prefix's objects say of its steps, and garbage collection of what killed writers left.

A step is committed when its manifest object is there (:func:`committed_steps`); anything else under
``step-N/`` is an upload at work or a dead writer's leftovers. :func:`collect_garbage` judges each
step by its claim, never by each object's age alone: nothing of an upload whose claim is live is
removed (tiers/storage/s3claim.py, :func:`~tiers.storage.s3claim.claim_is_live`), and the rest goes
once its newest object or uploaded part is older than the grace period.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime

from ..format.manifest import MANIFEST_NAME
from ..format.names import STEP_PREFIX, parse_step_name, step_name
from .objstore import ObjectMissingError, ObjectStore, StoredObject, Upload
from .s3claim import CLAIM_NAME, claim_is_live, parse_claim


def step_of_object(name: str) -> int | None:
    """The step whose prefix holds object ``name`` (``step-N/...``), or None for any other name."""
    head, slash, _ = name.partition("/")
    return parse_step_name(head) if slash else None


def committed_steps(objects: list[StoredObject]) -> set[int]:
    """The steps among ``objects`` whose manifest object is there."""
    found = set()
    for o in objects:
        head, _, rest = o.name.partition("/")
        if rest == MANIFEST_NAME and (step := parse_step_name(head)) is not None:
            found.add(step)
    return found


@dataclass
class Leftover:
    """What gc found under the prefix: an orphan object or an incomplete upload, and what it did."""

    what: str  # the s3:// URL of the object, or of the upload's key
    kind: str  # "orphan object", "stale claim" or "incomplete upload"
    removed: bool
    age_s: float = 0.0  # since the object was written, or the upload last received a part


def collect_garbage(store: ObjectStore, older_than: float, dry_run: bool = False) -> list[Leftover]:
    """Remove what killed writers left, judged step by step by the step's claim: nothing of a step whose
    claim is live (its writer runs on this host, or, on another host, the claim is younger than
    ``older_than`` seconds: :func:`~tiers.storage.s3claim.claim_is_live`); of any other step without a
    manifest, its objects, incomplete multipart uploads and claim once the newest of them is older than
    ``older_than``; of a committed step, only a claim or incomplete upload left behind, once older. A
    committed step's data is never touched."""
    now = datetime.now(UTC)
    objects: dict[int, list[StoredObject]] = defaultdict(list)
    uploads: dict[int, list[Upload]] = defaultdict(list)
    for o in store.list(STEP_PREFIX):
        if (step := step_of_object(o.name)) is not None:
            objects[step].append(o)
    for u in store.uploads():
        if (step := step_of_object(u.name)) is not None:
            uploads[step].append(u)
    committed = committed_steps([o for listed in objects.values() for o in listed])
    found: list[Leftover] = []
    for step in sorted(set(objects) | set(uploads)):
        found += _step_garbage(store, step, objects[step], uploads[step], step in committed, older_than, now, dry_run)
    return found

def _step_garbage(
store: ObjectStore,
step: int,
    objects: list[StoredObject],
    uploads: list[Upload],
    committed: bool,
    older_than: float,
    now: datetime,
    dry_run: bool,
) -> list[Leftover]:
    """What :func:`collect_garbage` removes of one step (see there)."""
    claim_name = f"{step_name(step)}/" + CLAIM_NAME
    claim = next((o for o in objects if o.name == claim_name), None)
    if claim is not None:
        try:
            held = parse_claim(store.get_bytes(claim_name))
        except ObjectMissingError:
            held, claim = {}, None  # released meanwhile
        if claim is not None and claim_is_live(held, (now - claim.modified).total_seconds(), older_than):
            return []  # an upload at work, wherever its objects' ages stand
    data = [] if committed else [o for o in objects if o.name != claim_name]
    times = [o.modified for o in [*data, *([claim] if claim else [])]] + [u.last_active for u in uploads]
    if not times or (now - max(times)).total_seconds() < older_than:
        return []
    if not dry_run and claim is not None and not store.delete_if(claim.name, claim.etag):
        return []  # another writer took the step over meanwhile: its upload, not garbage
    if not dry_run:
        store.delete([o.name for o in data])
        for upload in uploads:
            store.abort_upload(upload)
    removed = not dry_run
    found = [Leftover(store.where(o.name), "orphan object", removed, (now - o.modified).total_seconds())
             for o in data]  # fmt: skip
    if claim is not None:
        found.append(Leftover(store.where(claim.name), "stale claim", removed,
                              (now - claim.modified).total_seconds()))  # fmt: skip
    found += [Leftover(store.where(u.name), "incomplete upload", removed,
                       (now - u.last_active).total_seconds()) for u in uploads]  # fmt: skip
    return found
