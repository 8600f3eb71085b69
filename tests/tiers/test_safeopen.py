"""tiers.storage.safeopen, the only file opens inside a tier: symlinks are never followed, FIFOs never opened
(so nothing blocks), new files are new, and a replace never goes through or over a symlink."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from tierstate.tiers.storage.safeopen import (
    UnsafeFileError,
    create_new,
    make_dir,
    open_or_create,
    read_bytes,
    remove,
    write_durably,
)


@pytest.fixture
def precious(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    return outside


def test_reads_refuse_symlinks_and_fifos_without_blocking(tmp_path: Path, precious: Path) -> None:
    (tmp_path / "link").symlink_to(precious)
    os.mkfifo(tmp_path / "fifo")  # no writer: a plain open for reading would block forever
    with pytest.raises(UnsafeFileError, match="link: is a symlink") as refused:
        read_bytes(tmp_path / "link")
    assert refused.value.errno == errno.ELOOP
    with pytest.raises(UnsafeFileError, match="fifo: is a FIFO, not a regular file"):
        read_bytes(tmp_path / "fifo")
    with pytest.raises(UnsafeFileError, match="fifo: is a FIFO"):
        open_or_create(tmp_path / "fifo")
    (tmp_path / "plain").write_bytes(b"ok")
    assert read_bytes(tmp_path / "plain") == b"ok"


def test_new_files_are_never_written_through_a_dangling_or_live_symlink(tmp_path: Path, precious: Path) -> None:
    (tmp_path / "live").symlink_to(precious)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for name in ("live", "dangling"):
        with pytest.raises(UnsafeFileError, match=f"{name}: already exists \\(a symlink\\)"):
            create_new(tmp_path / name)
        with pytest.raises(UnsafeFileError, match=f"{name}: is a symlink"):
            open_or_create(tmp_path / name)
    assert precious.read_bytes() == b"keep" and not (tmp_path / "nowhere").exists()


def test_write_durably_removes_a_planted_temporary_and_refuses_a_symlinked_target(
    tmp_path: Path, precious: Path
) -> None:
    (tmp_path / "stamp.tmp").symlink_to(precious)  # the name older versions wrote through: removed by its name
    write_durably(tmp_path / "stamp", b"new")
    assert (tmp_path / "stamp").read_bytes() == b"new" and precious.read_bytes() == b"keep"
    assert sorted(os.listdir(tmp_path)) == ["outside", "stamp"]
    (tmp_path / "stamp").unlink()
    (tmp_path / "stamp").symlink_to(precious)
    with pytest.raises(UnsafeFileError, match="stamp: is a symlink"):
        write_durably(tmp_path / "stamp", b"new")
    assert precious.read_bytes() == b"keep"


def test_writers_of_one_file_at_once_each_replace_it_whole(tmp_path: Path) -> None:
    """Two nodes stamping the step they both saw published, or ``tierstate verify`` during a flush: with one
    shared temporary name, one writer's create collided with, or its rename lost, the other's temporary."""
    target = tmp_path / "verified.json"
    bodies = [bytes([i]) * 65536 for i in range(4)]
    start = threading.Barrier(len(bodies))
    failures: list[BaseException] = []

    def stamp(body: bytes) -> None:
        start.wait()
        for _ in range(40):
            try:
                write_durably(target, body)
            except OSError as error:
                failures.append(error)

    writers = [threading.Thread(target=stamp, args=(body,)) for body in bodies]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert failures == []
    assert target.read_bytes() in bodies and os.listdir(tmp_path) == ["verified.json"]


def test_remove_and_make_dir_never_reach_through_a_symlink(tmp_path: Path, precious: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "inside").write_bytes(b"keep")
    (tmp_path / "linked-dir").symlink_to(elsewhere)
    with pytest.raises(UnsafeFileError, match="linked-dir: is a symlink, not a directory"):
        make_dir(tmp_path / "linked-dir")
    remove(tmp_path / "linked-dir")
    assert not os.path.lexists(tmp_path / "linked-dir") and (elsewhere / "inside").read_bytes() == b"keep"
    remove(tmp_path / "absent")  # nothing there is fine
