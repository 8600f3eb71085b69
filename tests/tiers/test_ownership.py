"""A tier path in another user's hands is refused at runner construction, naming the tier and path
(as ssh's StrictModes refuses ~/.ssh). The tests run as root and hand entries to another uid."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tierstate import Runner, TierError

OTHER = 12345  # a user that is neither root nor this process's


def _runner(path: Path) -> Runner:
    return Runner.from_dict({"tiers": {"nvme": {"path": str(path)}}})


@pytest.fixture
def shared_tmp(tmp_path: Path) -> Path:
    """A shared sticky directory like /tmp: world-writable, sticky, root's."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    return shared


def test_a_symlink_another_user_planted_in_a_sticky_directory_is_refused(tmp_path: Path, shared_tmp: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    link = shared_tmp / "ckpt"
    link.symlink_to(theirs, target_is_directory=True)
    os.lchown(link, OTHER, OTHER)
    with pytest.raises(TierError, match=rf"tier nvme: {link} is refused: {link} is a symlink owned by uid {OTHER}"):
        _runner(link)
    assert list(theirs.iterdir()) == []  # no probe, no lock, nothing written there
    os.lchown(link, os.geteuid(), os.getegid())  # the same link, this user's own: the user's choice
    _runner(link).close()


def test_a_tier_directory_another_user_owns_is_refused(shared_tmp: Path) -> None:
    theirs = shared_tmp / "ckpt"
    theirs.mkdir()
    os.chmod(theirs, 0o777)
    os.chown(theirs, OTHER, OTHER)
    with pytest.raises(TierError, match=rf"{theirs} is owned by uid {OTHER}, not by this user or root"):
        _runner(theirs)
    assert list(theirs.iterdir()) == []


def test_a_world_writable_directory_without_sticky_bit_on_the_path_is_refused(tmp_path: Path) -> None:
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    os.chmod(open_to_all, 0o777)
    with pytest.raises(TierError, match=rf"{open_to_all} is writable by every user \(mode 777, no sticky bit\)"):
        _runner(open_to_all / "run7" / "nvme")
    assert not (open_to_all / "run7").exists()


def test_a_group_writable_directory_of_another_group_is_refused_unless_sticky(tmp_path: Path) -> None:
    """Group-writable is world-writable for the members of that group, unless the group is root's or the
    user's own: they could rename the tier away and put their own in its place."""
    project = tmp_path / "project"
    project.mkdir()
    os.chmod(project, 0o775)
    os.chown(project, OTHER, OTHER)
    with pytest.raises(TierError, match=rf"{project} is writable by every member of group {OTHER}, not this "
                       r"user's own \(mode 775, no sticky bit\)"):  # fmt: skip
        _runner(project / "me" / "nvme")
    assert not (project / "me").exists()
    os.chmod(project, 0o1775)  # sticky: members cannot rename what is not theirs
    _runner(project / "me" / "nvme").close()
    os.chmod(project, 0o775)
    os.chown(project, OTHER, 0)  # root's group
    _runner(project / "me" / "nvme").close()


def test_ordinary_paths_pass(tmp_path: Path, shared_tmp: Path) -> None:
    mine = shared_tmp / "mine"  # under a sticky world-writable directory, this user's own
    mine.mkdir()
    link = tmp_path / "scratch"  # this user's symlink to it
    link.symlink_to(mine, target_is_directory=True)
    project = tmp_path / "project"  # another user's directory only they can write, holding mine
    project.mkdir(mode=0o755)
    (project / "me").mkdir()
    os.chown(project, OTHER, OTHER)
    for path in (mine / "nvme", link / "nvme", project / "me" / "nvme"):
        _runner(path).close()
