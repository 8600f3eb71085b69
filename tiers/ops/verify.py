"""``tierstate verify``: every checksum of a committed checkpoint recomputed, and the stamp it leaves.

Restore verifies only the frames it reads; ``verify`` reads them all, through the read object
(``StoredCheckpoint.verify``, the checks in tiers/reading/integrity.py) (data frames, the HDF5
library's own bytes, the indexes) and names each bad one by file, frame and byte range. Each pass
leaves a stamp (``verified.json``: for which manifest, when, and what was wrong) that ``tierstate
ls`` shows as state ``verified`` or ``damaged``, until the next pass replaces it. The stamp is
advisory: it is not part of the checkpoint, is never copied, and means only "was intact (or not)
when last checked".
A stamp that cannot be written (a read-only or full tier) is a warning beside the result, never a
failure.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..format.format import ManifestError, checksum, now_iso
from ..format.manifest import MANIFEST_NAME
from ..reading.integrity import Problem, Progress
from ..reading.source import as_source
from ..reading.stored import StoredCheckpoint
from ..storage.filesystem import InvalidEntry
from ..storage.safeopen import UnsafeFileError, read_bytes, remove, write_durably
from ..storage.tier import Tier

STAMP_NAME = "verified.json"


def _manifest_id(directory: Path) -> str:
    return checksum(read_bytes(directory / MANIFEST_NAME))


@dataclass(frozen=True)
class Stamp:
    """What the last full verification of a checkpoint (of this very manifest) found, and when."""

    ok: bool
    at: str
    problems: tuple[str, ...] = ()


def write_stamp(directory: Path, problems: Sequence[Problem] = ()) -> str | None:
    """Record that the checkpoint in ``directory`` has just passed a full verification, or failed it with
    ``problems``; why it could not be recorded (the directory is read-only, full or gone), or None.
    Something planted under the stamp's name is refused (UnsafeFileError), never written through."""
    try:
        stamp: dict[str, object] = {"manifest": _manifest_id(directory)}  # gone if retention pruned it meanwhile
        if problems:
            stamp |= {"damaged_at": now_iso(), "problems": [str(p) for p in problems]}
        else:
            stamp["verified_at"] = now_iso()
        write_durably(directory / STAMP_NAME, json.dumps(stamp).encode())
    except UnsafeFileError:
        raise
    except OSError as exc:
        return f"{directory / STAMP_NAME}: not recorded: {exc.strerror or exc}"
    return None


def read_stamp(directory: Path) -> Stamp | None:
    """What the last verification of the checkpoint (this very manifest) found, or None if it was not
    verified since the manifest was written."""
    try:
        stamp = json.loads(read_bytes(directory / STAMP_NAME))
        if stamp["manifest"] != _manifest_id(directory):
            return None
        if "damaged_at" in stamp:
            return Stamp(False, stamp["damaged_at"], tuple(stamp["problems"]))
        return Stamp(True, stamp["verified_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class VerifyResult:
    tier: str
    step: int
    path: Path | str  # the step's directory, or its s3:// prefix on a bucket
    bytes: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # about the stamp only: the result stands

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, object]:
        return {
            "tier": self.tier,
            "step": self.step,
            "path": str(self.path),
            "ok": self.ok,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 4),
            "problems": [str(p) for p in self.problems],
            "warnings": self.warnings,
        }


def invalid_result(tier: Tier, entry: InvalidEntry) -> VerifyResult:
    """The failed verification of a ``step-N`` entry that is no checkpoint (a lost manifest, a symlink):
    nothing in it is read."""
    return VerifyResult(tier.name, entry.step, entry.path, problems=[Problem(entry.what, None, entry.reason)])


def verify_step(tier: Tier, step: int, progress: Progress | None = None) -> VerifyResult:
    """Verify one committed checkpoint of ``tier`` (a directory or a bucket prefix, read through the same
    checks), holding it against deletion meanwhile; a directory's copy gets its stamp."""
    location = as_source(tier.location(step))
    result = VerifyResult(tier.name, step, location.local_directory or location.where)
    started = time.perf_counter()
    with location.reading():  # held through the stamp, so not StoredCheckpoint.locked: a bad manifest is a result
        try:
            checkpoint = StoredCheckpoint(location, step)
        except ManifestError as exc:
            result.problems.append(Problem(MANIFEST_NAME, None, str(exc)))
        else:
            result.bytes = checkpoint.manifest.stored_bytes
            result.problems = checkpoint.verify(progress)
        if location.local_directory is not None:
            _stamp(location.local_directory, result)
    result.seconds = time.perf_counter() - started
    return result


def _stamp(directory: Path, result: VerifyResult) -> None:
    """Leave ``result`` in the checkpoint directory (a damaged copy stays marked until found clean)."""
    manifest = directory / MANIFEST_NAME
    if not manifest.is_file() or manifest.is_symlink():
        return
    try:
        warning = write_stamp(directory, result.problems)
    except UnsafeFileError as exc:  # something planted under the stamp's name: removed, not followed
        result.problems.append(Problem(STAMP_NAME, None, exc.reason))
        remove(directory / STAMP_NAME)
    else:
        if warning:
            result.warnings.append(warning)
