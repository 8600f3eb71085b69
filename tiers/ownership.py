"""Whose hands a tier path is in, checked the way ssh's ``StrictModes`` checks ``~/.ssh``.

Every file inside a tier is opened without following symlinks (safeopen.py); the tier path itself is
the user's and may hold symlinks (``/scratch -> /lustre/scratch``). But a symlink on it that another
user owns (planted in a shared sticky directory such as ``/tmp``), a tier directory another user
owns, or a world-writable directory on the path without the sticky bit, hands that user the choice
of where checkpoints are written and what a restore reads. Those are refused; root and the
process's own user are trusted, as ssh trusts them.

Not refused: directories on the path owned by another user that only they (and their group) can
write, a project directory owned by its PI on a cluster file system: the owner of a directory can
always rename what is in it, and trusting them is what placing the tier there means.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

_MAX_LINKS = 40  # as the kernel's ELOOP bound: a cycle of symlinks ends here


def ownership_problem(path: Path, uid: int | None = None) -> str | None:
    """Why ``path`` (a tier directory, existing or to be created) is in another user's hands, or None."""
    trusted = {0, os.geteuid() if uid is None else uid}
    return _walk(Path(os.path.abspath(path)), trusted, _MAX_LINKS)


def _walk(path: Path, trusted: set[int], links: int) -> str | None:
    current = Path(path.anchor)
    parts = path.parts[1:]
    for i, part in enumerate(parts):
        current = current / part
        try:
            st = os.lstat(current)
        except (FileNotFoundError, NotADirectoryError):
            return None  # created later, by this user, under what was checked
        last = i == len(parts) - 1
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in trusted:
                return f"{current} is a symlink owned by uid {st.st_uid}, who chooses where it points"
            if links == 0:
                return f"{current}: too many levels of symbolic links"
            target = Path(os.path.join(current.parent, os.readlink(current)))
            rest = Path(*parts[i + 1 :]) if not last else Path()
            return _walk(Path(os.path.normpath(target / rest)), trusted, links - 1)
        if not stat.S_ISDIR(st.st_mode):
            return None  # a file in the way: tierpaths.py says so
        if last and st.st_uid not in trusted:
            return f"{current} is owned by uid {st.st_uid}, not by this user or root"
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            return f"{current} is writable by every user (mode {stat.S_IMODE(st.st_mode):o}, no sticky bit)"
    return None
