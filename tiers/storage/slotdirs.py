"""The slot pool of a memory tier on disk: where its free data files wait, and how retention returns them.

A memory tier whose writer captures straight into its files (tiers/storage/slots.py) keeps each
rank's free data files in ``<tier>/.slots/rank-NNNNN/``: preallocated, their pages resident, mapped by
the writer. A checkpoint takes one, renames it into its ``step-N.partial/`` and writes it in place;
when retention deletes an older step, :func:`recycle` moves each rank's data file back into its pool
instead of unlinking it, so the next checkpoint finds its memory allocated and faulted in. Which
process deletes (the runner's retention, ``tierstate prune``, a node agent) does not matter: the pool
is a directory of the tier, and a rank's pool exists exactly while its writer holds one (it is
removed when the writer closes; a killed writer's stays, and the next writer adopts its files).

Nothing here needs torch, so the tier's listing, retention and the CLI stay free of it. No name in
the pool is trusted: only regular files named ``free-*`` are free slots, never followed; anything
else is left alone.

A tier too small for its slots must fail when the runner is built, not with SIGBUS when a mapped page
cannot be allocated mid-copy (Docker's default 64 MB ``/dev/shm``): :func:`room_problem` compares the
tier's ``size`` with what its file system can still give it.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from pydantic import ByteSize

from ..format.names import parse_rank_dir, parse_rank_file, rank_dir_name
from .safeopen import is_real_dir

POOL = ".slots"  # not a step name: listings, retention and gc never take it for a checkpoint
FREE_PREFIX = "free-"
#: The most free files a pool takes back: a checkpoint needs one, and a pool whose writer was killed takes no
#: more than that while nobody draws from it (the rest go with their steps).
POOL_MOST = 2


def pools_dir(root: Path) -> Path:
    return root / POOL


def pool_dir(root: Path, rank: int) -> Path:
    """Rank ``rank``'s free data files in the tier at ``root``."""
    return pools_dir(root) / rank_dir_name(rank)


def free_name() -> str:
    """A fresh name for a file entering a pool (unique: two deletions may return files at once)."""
    return f"{FREE_PREFIX}{uuid.uuid4().hex}"


def free_files(pool: Path) -> list[os.DirEntry[str]]:
    """The free slots of ``pool``: its regular files named ``free-*`` (nothing when it is no real directory)."""
    if not is_real_dir(pool):
        return []
    try:
        with os.scandir(pool) as listing:
            return [e for e in listing if e.name.startswith(FREE_PREFIX) and e.is_file(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def pool_holdings(root: Path) -> dict[int, tuple[int, int]]:
    """Each rank's pool in the tier at ``root``: how many free files it holds and the bytes they keep allocated
    (what ``tierstate ls`` shows; empty where no runner captures into slots)."""
    holdings = {}
    pools = pools_dir(root)
    if not is_real_dir(pools):
        return {}
    for entry in sorted(os.scandir(pools), key=lambda e: e.name):
        rank = parse_rank_dir(entry.name)
        if rank is None or not entry.is_dir(follow_symlinks=False):
            continue
        free = free_files(Path(entry.path))
        holdings[rank] = (len(free), sum(f.stat(follow_symlinks=False).st_blocks * 512 for f in free))
    return holdings


def recycle(root: Path, doomed: Path) -> int:
    """Move each frames data file of ``doomed`` (a deleted step's directory, already out of the listing)
    into its rank's pool, where that rank has one; the number moved. What stays is removed by the caller.

    Only ``rank-NNNNN.data`` files that are regular files move (an HDF5 file or an index is no slot), and
    only into a pool that is a real directory holding fewer than :data:`POOL_MOST` free files; a rename never
    follows a symlink.
    """
    if not is_real_dir(pools_dir(root)):
        return 0
    moved = 0
    with os.scandir(doomed) as listing:
        entries = list(listing)
    for entry in entries:
        parsed = parse_rank_file(entry.name)
        if parsed is None or parsed.kind != "data" or not entry.is_file(follow_symlinks=False):
            continue
        pool = pool_dir(root, parsed.rank)
        if not is_real_dir(pool) or len(free_files(pool)) >= POOL_MOST:  # a symlink in its place is never followed
            continue
        try:
            os.rename(entry.path, pool / free_name())
        except FileNotFoundError:
            continue  # the pool was removed meanwhile (its writer closed): the file goes with the step
        moved += 1
    return moved


def _human(nbytes: int) -> str:
    return ByteSize(nbytes).human_readable()


def room_problem(name: str, path: Path, size: int, held: int) -> str | None:
    """Why tier ``name`` (``size`` bytes, at ``path``, ``held`` of them already in its directory) cannot keep its
    files preallocated there: its file system has less room left for it than ``size``; None when it has.

    ``held`` counts: what the tier holds already (older checkpoints, a killed writer's slots) is reused.
    """
    existing = next((p for p in (path, *path.parents) if p.is_dir()), None)
    if existing is None:
        return None  # the path check names it
    stat = os.statvfs(existing)
    room = stat.f_bavail * stat.f_frsize + held
    if room >= size:
        return None
    total = stat.f_blocks * stat.f_frsize
    return (
        f"tiers.{name}.size is {_human(size)}, but the file system of {path} has room for {_human(room)} of it "
        f"({_human(total)} in all): the memory tier preallocates its files there and captures straight into "
        f"them, so it needs {_human(size)}; give that file system more room (Docker: docker run "
        f"--shm-size={-(-size // (1 << 30)) + 1}g; a tmpfs: mount -o remount,size=... {existing}), or lower "
        f"tiers.{name}.size"
    )
