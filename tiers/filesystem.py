"""A durable tier that is a POSIX directory (local NVMe, or a Lustre/GPFS mount).

Layout: ``<root>/step-N/`` is a committed checkpoint; ``<root>/step-N.partial/`` is one being
written (or left by a crash). The commit protocol of DESIGN.md lives here: fsync the files, write
the manifest last (itself via fsync + rename), rename the partial directory to its final name and
fsync the parent, so that after a crash a directory either is a complete checkpoint or is not one.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from tierstate.errors import TierstateError

from . import faults
from .format import (
    MANIFEST_NAME,
    Manifest,
    ManifestBody,
    ManifestError,
    manifest_bytes,
    read_manifest,
    write_durably,
)

STEP_DIR_RE = re.compile(r"^step-(\d+)$")
PARTIAL_SUFFIX = ".partial"


class TierError(TierstateError, OSError):
    """A tier operation failed; the message names the tier and the path."""


class CheckpointExistsError(TierError):
    pass


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class FilesystemTier:
    name: str
    root: Path

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def partial_dir(self, step: int) -> Path:
        return self.root / f"step-{step}{PARTIAL_SUFFIX}"

    def begin(self, step: int) -> Path:
        """Create a fresh partial directory for ``step``; a leftover partial of the same step is replaced."""
        if self.step_dir(step).exists():
            raise CheckpointExistsError(
                f"tier {self.name}: checkpoint step {step} already exists at {self.step_dir(step)}"
            )
        partial = self.partial_dir(step)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir()
        except OSError as exc:
            # The errno is kept so callers can tell a full disk from a read-only one without parsing text.
            raise TierError(exc.errno, f"tier {self.name}: cannot create {partial}: {exc.strerror or exc}") from exc
        faults.point("begin", partial)
        return partial

    def commit(self, step: int, manifest: Manifest | ManifestBody) -> Path:
        """Manifest last, then the atomic rename; only after this does ``step`` exist on the tier."""
        partial = self.partial_dir(step)
        for child in partial.iterdir():
            with open(child, "rb") as handle:
                os.fsync(handle.fileno())
        write_durably(partial / MANIFEST_NAME, manifest_bytes(manifest))
        fsync_dir(partial)
        faults.point("commit.manifest", partial)
        final = self.step_dir(step)
        os.rename(partial, final)
        faults.point("commit.rename", final)
        fsync_dir(self.root)
        return final

    def abort(self, step: int) -> None:
        """Remove what a failed checkpoint wrote; the committed checkpoints are not touched."""
        shutil.rmtree(self.partial_dir(step), ignore_errors=True)

    def steps(self) -> list[int]:
        """Committed steps, ascending: directories named step-N whose manifest is present."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in os.scandir(self.root):
            match = STEP_DIR_RE.match(entry.name)
            if match and entry.is_dir() and os.path.isfile(os.path.join(entry.path, MANIFEST_NAME)):
                found.append(int(match.group(1)))
        return sorted(found)

    def manifest(self, step: int) -> Manifest:
        manifest = read_manifest(self.step_dir(step))
        if manifest.step != step:
            raise ManifestError(f"{self.step_dir(step)}: manifest is for step {manifest.step}")
        return manifest

    def partials(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.name.endswith(PARTIAL_SUFFIX) and p.is_dir())
