"""Whose hands a tier path is in, checked the way ssh's ``StrictModes`` checks ``~/.ssh``.

Every file inside a tier is opened without following symlinks (safeopen.py); the tier path itself is
the user's and may hold symlinks (``/scratch -> /lustre/scratch``). But a symlink on it that another
user owns (planted in a shared sticky directory such as ``/tmp``), a tier directory another user
owns, or a directory on the path that other users can write without the sticky bit (world-writable,
or group-writable by a group other than root's or the user's own), hands those users the choice of
where checkpoints are written and what a restore reads. Those are refused; root and the process's
own user are trusted, as ssh trusts them. The user's own group is a user private group: their primary
group, named as they are, listing no other member (a shared primary group such as ``users`` is not).

Not refused: directories on the path owned by another user that only they can write, a project
directory owned by its PI on a cluster file system: the owner of a directory can always rename what
is in it, and trusting them is what placing the tier there means. A project directory its group
writes needs the sticky bit (``chmod +t``), as ``/tmp`` has, so that members cannot rename each
other's entries.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from pathlib import Path

_MAX_LINKS = 40  # as the kernel's ELOOP bound: a cycle of symlinks ends here


def ownership_problem(path: Path, uid: int | None = None) -> str | None:
    """Why ``path`` (a tier directory, existing or to be created) is in another user's hands, or None."""
    user = os.geteuid() if uid is None else uid
    return _walk(Path(os.path.abspath(path)), {0, user}, _own_groups(user), _MAX_LINKS)


def _own_groups(uid: int) -> set[int]:
    """Root's group and the user's own (a user private group: their primary group, named as they are,
    listing no other member)."""
    groups = {0}
    try:
        user = pwd.getpwuid(uid)
        group = grp.getgrgid(user.pw_gid)
    except KeyError:  # a uid or gid without an entry: nothing more is known to be theirs alone
        return groups
    if group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}:
        groups.add(user.pw_gid)
    return groups


def _walk(path: Path, trusted: set[int], groups: set[int], links: int) -> str | None:
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
            return _walk(Path(os.path.normpath(target / rest)), trusted, groups, links - 1)
        if not stat.S_ISDIR(st.st_mode):
            return None  # a file in the way: tierpaths.py says so
        if last and st.st_uid not in trusted:
            return f"{current} is owned by uid {st.st_uid}, not by this user or root"
        mode = f"mode {stat.S_IMODE(st.st_mode):o}, no sticky bit"
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            return f"{current} is writable by every user ({mode})"
        if st.st_mode & stat.S_IWGRP and st.st_gid not in groups and not st.st_mode & stat.S_ISVTX:
            return f"{current} is writable by every member of group {st.st_gid}, not this user's own ({mode})"
    return None
