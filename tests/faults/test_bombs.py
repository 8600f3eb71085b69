"""Resource bombs in forged checkpoints: a size a manifest claims costs no memory the files do not back.

The forger has write access to the tier and re-signs the manifest (its self-checksum is an
integrity check, not a signature). The bombs:

- a frame (or the item in it) claiming 64 GiB over a data file made that long by ``truncate``:
  sparse, so the claim costs the forger nothing; the frame's checksum is the original one;
- a zstd frame within zstd's ratio, frame checksum recomputed, whose few stored kilobytes decode
  to gigabytes: once as a frame holding a 1 MiB item, once as an item claiming all of it;
- 4,000 column shards of one tensor, which made validating the manifest quadratic.

Each restore runs in a child process whose address space is capped a little above what it uses
once warmed up (one restore done), so a read that allocates on a claim fails there at once
instead of swapping the machine; the child reports its peak RSS growth and what it restored.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zstandard

from faultkit import REPO, expected, state_matches, trainer, write_steps
from tierstate.errors import TierstateError
from tierstate.tiers.format.codecs import shuffle
from tierstate.tiers.format.format import checksum, manifest_bytes, now_iso
from tierstate.tiers.format.manifest import MANIFEST_NAME
from tierstate.tiers.reading.stored import load

pytestmark = pytest.mark.faults

DATA = "rank-00000.data"
GiB = 1 << 30
HEADROOM = GiB  # address space the child may add to what it holds after warming up
MAX_GROWTH = 256 << 20  # peak RSS growth allowed for reading a bomb (the real state is ~4 MiB)
CHILD_TIMEOUT = 180


# --- the child process -----------------------------------------------------------------------------


def restore_capped(root: str) -> None:
    """In the child: restore step 1 (warming up), cap the address space, restore the latest with
    fallback; print one JSON line: what was restored (or the error), and the peak RSS growth."""
    with trainer(Path(root)) as (runner, state):
        runner.restore(1)
        _cap_address_space(HEADROOM)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started = time.perf_counter()
        try:
            result = runner.restore("latest", fallback=True)
            outcome: dict[str, Any] = {
                "step": result.step,
                "problems": list(result.problems),
                "exact": state_matches(state, result.step),
            }
        except Exception as exc:  # reported to the test, which names it
            outcome = {"error": f"{type(exc).__name__}: {exc}", "tierstate": isinstance(exc, TierstateError)}
        outcome["seconds"] = time.perf_counter() - started
        outcome["growth"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    print(json.dumps(outcome))


def _cap_address_space(headroom: int) -> None:
    with open("/proc/self/statm") as statm:
        size = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (size + headroom, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _restore_in_child(root: Path) -> dict[str, Any]:
    path = os.pathsep.join([str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    code = f"import test_bombs; test_bombs.restore_capped({str(root)!r})"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": path},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- forging -----------------------------------------------------------------------------------------


def _forge(directory: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit the manifest body and re-sign it."""
    body = json.loads((directory / MANIFEST_NAME).read_bytes())["manifest"]
    edit(body)
    (directory / MANIFEST_NAME).write_bytes(manifest_bytes(body))


def _frame_of(body: dict[str, Any], key: str) -> dict[str, Any]:
    [piece] = body["items"][key]["pieces"]
    return body["files"][DATA]["frames"][piece["frame"]]


def _grow_frame(body: dict[str, Any], frame: dict[str, Any], length: int, raw_length: int) -> None:
    """Make ``frame`` ``length`` bytes long, moving the frames after it along (the file grows too)."""
    shift = length - frame["length"]
    for other in body["files"][DATA]["frames"]:
        if other["offset"] > frame["offset"]:
            other["offset"] += shift
    body["files"][DATA]["size"] += shift
    frame.update(length=length, raw_length=raw_length)


def _claim_item(body: dict[str, Any], key: str, nbytes: int) -> None:
    """Item ``key`` (alone in its frame) claims ``nbytes``: its shape and its piece grow to it."""
    item = body["items"][key]
    item["shape"] = [nbytes // 4]
    item["pieces"][0]["length"] = nbytes


def _splice(directory: Path, offset: int, old_length: int, new: bytes, new_length: int) -> None:
    """Replace the ``old_length`` bytes at ``offset`` of the data file by ``new_length`` bytes: ``new``,
    then a hole up to ``new_length`` (sparse: nothing stored); what followed moves along."""
    path = directory / DATA
    tail = path.read_bytes()[offset + old_length :]
    with open(path, "r+b") as out:
        out.truncate(offset)
        out.seek(offset)
        out.write(new)
        out.seek(offset + new_length)
        out.write(tail)
        out.truncate(offset + new_length + len(tail))


# --- 64 GiB over a sparse file -------------------------------------------------------------------------


@pytest.mark.parametrize("claim", ["frame", "item"])
def test_64_gib_claimed_over_a_sparse_file_costs_no_memory_and_falls_back(tmp_path: Path, claim: str) -> None:
    """Frame checksums are the original ones: the holes hash to something else, found before a byte
    is allocated for them (they are hashed, not read), and ``fallback=True`` restores step 1."""
    write_steps(tmp_path, [1, 2])
    step2 = tmp_path / "nvme" / "step-2"

    def edit(body: dict[str, Any]) -> None:
        frame = _frame_of(body, "t/c")
        _grow_frame(body, frame, 64 * GiB, 64 * GiB)
        if claim == "item":
            _claim_item(body, "t/c", 64 * GiB)
        original = (step2 / DATA).read_bytes()[frame["offset"] :][: 1 << 20]
        _splice(step2, frame["offset"], len(original), original, 64 * GiB)

    _forge(step2, edit)
    assert (step2 / DATA).stat().st_size > 64 * GiB and (step2 / DATA).stat().st_blocks * 512 < 16 << 20
    outcome = _restore_in_child(tmp_path)
    assert "error" not in outcome, outcome["error"]
    assert outcome["step"] == 1 and outcome["exact"]
    assert len(outcome["problems"]) == 1 and "checksum mismatch" in outcome["problems"][0]
    assert outcome["growth"] < MAX_GROWTH


# --- zstd bombs --------------------------------------------------------------------------------------


def _zstd_bomb(planes: list[bytes], raw_length: int) -> bytes:
    """A zstd frame of ``raw_length`` bytes: each of the ``len(planes)`` equal planes starts with its
    given bytes and is zeros after them. Streamed, so building it takes no gigabytes either."""
    plane_length = raw_length // len(planes)
    compressor = zstandard.ZstdCompressor(level=3).compressobj(size=raw_length)
    zeros = bytes(64 << 20)
    out = []
    for plane in planes:
        out.append(compressor.compress(plane))
        left = plane_length - len(plane)
        while left:
            out.append(compressor.compress(zeros[: min(left, len(zeros))]))
            left -= min(left, len(zeros))
    out.append(compressor.flush())
    return b"".join(out)


@pytest.mark.parametrize("width", [1, 4])
def test_a_zstd_frame_expanding_to_gigabytes_keeps_only_what_its_pieces_need(tmp_path: Path, width: int) -> None:
    """2 GiB (within zstd's ratio) from ~65 KB: the 1 MiB item in it comes back bit-exact, the rest
    is never held. The stream is decoded to its end (its stated 2 GiB checked, as verify checks it),
    a block at a time; width 1 keeps the item's bytes from the first block, width 4 (byte planes)
    each item byte as its plane passes."""
    write_steps(tmp_path, [1, 2], pipeline__stages__compress__codec="zstd")
    step2 = tmp_path / "nvme" / "step-2"
    item = expected(2)["c"].view(torch.uint8).numpy().tobytes()
    shuffled = bytes(shuffle(item, width))
    planes = [shuffled[j * len(item) // width : (j + 1) * len(item) // width] for j in range(width)]
    raw_length = 2 * GiB

    def edit(body: dict[str, Any]) -> None:
        frame = _frame_of(body, "t/c")
        assert [p["offset"] for p in body["items"]["t/c"]["pieces"]] == [0] and frame["codec"] == "zstd"
        bomb = _zstd_bomb(planes, raw_length)
        old_length = frame["length"]
        _grow_frame(body, frame, len(bomb), raw_length)
        frame.update(shuffle=width, checksum=checksum(bomb))
        _splice(step2, frame["offset"], old_length, bomb, len(bomb))

    _forge(step2, edit)
    outcome = _restore_in_child(tmp_path)
    assert "error" not in outcome, outcome["error"]
    assert outcome["step"] == 2 and outcome["exact"] and not outcome["problems"]
    assert outcome["growth"] < MAX_GROWTH


def test_an_item_claiming_more_memory_than_there_is_fails_cleanly_and_falls_back(tmp_path: Path) -> None:
    """A consistent forgery (frame checksum recomputed): the item really is 2 GiB of zeros. It cannot
    be allocated under the cap, which is a ReadTooLargeError naming it, and step 1 is restored."""
    write_steps(tmp_path, [1, 2], pipeline__stages__compress__codec="zstd")
    step2 = tmp_path / "nvme" / "step-2"
    raw_length = 2 * GiB

    def edit(body: dict[str, Any]) -> None:
        frame = _frame_of(body, "t/c")
        bomb = _zstd_bomb([b""], raw_length)
        old_length = frame["length"]
        _grow_frame(body, frame, len(bomb), raw_length)
        frame.update(shuffle=1, checksum=checksum(bomb))
        _claim_item(body, "t/c", raw_length)
        _splice(step2, frame["offset"], old_length, bomb, len(bomb))

    _forge(step2, edit)
    outcome = _restore_in_child(tmp_path)
    assert "error" not in outcome, outcome["error"]
    assert outcome["step"] == 1 and outcome["exact"]
    assert "item 't/c': cannot allocate the 2147483648 bytes" in outcome["problems"][0]
    assert outcome["growth"] < MAX_GROWTH


# --- thousands of shards -------------------------------------------------------------------------------

ROWS, COLUMNS = 16, 4000


def _column_shards(directory: Path) -> torch.Tensor:
    """A committed checkpoint of one [16, 4000] tensor saved as 4,000 column shards; the tensor."""
    whole = torch.arange(ROWS * COLUMNS, dtype=torch.float32).reshape(ROWS, COLUMNS)
    data = b"".join(whole[:, i].contiguous().numpy().tobytes() for i in range(COLUMNS))
    directory.mkdir(parents=True)
    (directory / DATA).write_bytes(data)
    column = ROWS * 4
    frame = {"offset": 0, "length": len(data), "raw_length": len(data), "codec": "none", "checksum": checksum(data)}
    shards = [
        {
            "kind": "tensor",
            "dtype": "float32",
            "shape": [ROWS, 1],
            "shard": {"global_shape": [ROWS, COLUMNS], "offsets": [0, i]},
            "pieces": [{"file": DATA, "frame": 0, "offset": i * column, "length": column, "item_offset": 0}],
        }
        for i in range(COLUMNS)
    ]
    body = {
        "format": "tierstate",
        "version": 2,
        "step": 1,
        "created": now_iso(),
        "world_size": 1,
        "files": {DATA: {"size": len(data), "frames": [frame]}},
        "indexes": {},
        "items": {"w": {"kind": "sharded", "dtype": "float32", "global_shape": [ROWS, COLUMNS], "shards": shards}},
    }
    (directory / MANIFEST_NAME).write_bytes(manifest_bytes(body))
    return whole


def test_four_thousand_column_shards_list_and_load_in_bounded_time(tmp_path: Path) -> None:
    """Checking that the shards tile the tensor is linear in the shards (it was quadratic: 77 s)."""
    whole = _column_shards(tmp_path / "nvme" / "step-1")
    listed = subprocess.run(
        [sys.executable, "-m", "tierstate", "ls", "--json", "--tier", f"nvme={tmp_path / 'nvme'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    [entry] = json.loads(listed.stdout)
    assert entry["state"] == "committed" and entry["items"] == 1
    started = time.perf_counter()
    assert torch.equal(load(tmp_path / "nvme" / "step-1")["w"], whole)
    assert time.perf_counter() - started < 10


# --- verify and migrate check what restore checks, before a byte is written ------------------------


def _cli_on_tiers(root: Path, *args: str) -> subprocess.CompletedProcess:
    tiers = [f"--tier={name}={root / name}" for name in ("nvme", "pfs")]
    return subprocess.run(
        [sys.executable, "-m", "tierstate", *args, *tiers], capture_output=True, text=True, timeout=CHILD_TIMEOUT
    )


def _allocated(directory: Path) -> int:
    """Bytes the files under ``directory`` hold on disk (holes not counted)."""
    return sum(p.stat().st_blocks * 512 for p in directory.rglob("*") if p.is_file() and not p.is_symlink())


def _refused_everywhere(root: Path, step: int, why: str) -> None:
    """``verify`` reports ``why`` for ``step``; ``migrate`` refuses it, leaving no copy and no bytes."""
    verified = _cli_on_tiers(root, "verify", str(step), "--only", "nvme")
    assert verified.returncode == 1 and why in verified.stdout, verified
    migrated = _cli_on_tiers(root, "migrate", str(step), "--from", "nvme", "--to", "pfs")
    assert migrated.returncode == 1 and why in migrated.stdout + migrated.stderr, migrated
    assert "Traceback" not in migrated.stderr
    assert not (root / "pfs" / f"step-{step}").exists()
    # The checkpoint is ~4 MiB: frames before the bad one may be copied (each verified first), never its claim.
    assert _allocated(root / "pfs") < 8 << 20, "migrate wrote bytes of a frame it had not verified"


def test_migrate_verifies_a_frame_before_writing_a_byte_of_it(tmp_path: Path) -> None:
    """The 44 KB forgery of a 64 GiB frame over a hole (its checksum the original one): migrate used to
    copy gigabytes into the target before it found the mismatch."""
    write_steps(tmp_path, [1, 2])
    step2 = tmp_path / "nvme" / "step-2"

    def edit(body: dict[str, Any]) -> None:
        frame = _frame_of(body, "t/c")
        _grow_frame(body, frame, 64 * GiB, 64 * GiB)
        original = (step2 / DATA).read_bytes()[frame["offset"] :][: 1 << 20]
        _splice(step2, frame["offset"], len(original), original, 64 * GiB)

    _forge(step2, edit)
    _refused_everywhere(tmp_path, 2, "checksum mismatch")


def test_a_zstd_frame_that_decodes_beyond_its_stated_size_fails_verify_and_migrate(tmp_path: Path) -> None:
    """Stored bytes re-signed, a frame that says it holds the item's bytes but decodes to 4 GiB: restore
    refuses it (zstd decodes to more than the manifest says); verify and migrate must too."""
    write_steps(tmp_path, [1, 2], pipeline__stages__compress__codec="zstd")
    step2 = tmp_path / "nvme" / "step-2"
    item = expected(2)["c"].view(torch.uint8).numpy().tobytes()

    def edit(body: dict[str, Any]) -> None:
        frame = _frame_of(body, "t/c")
        bomb = _zstd_bomb([item], 4 * GiB)
        old_length, stated = frame["length"], frame["raw_length"]
        _grow_frame(body, frame, len(bomb), stated)
        frame.update(shuffle=1, checksum=checksum(bomb))
        _splice(step2, frame["offset"], old_length, bomb, len(bomb))

    _forge(step2, edit)
    _refused_everywhere(tmp_path, 2, "decodes to more than")


def test_a_deeply_nested_index_fails_verify_and_migrate(tmp_path: Path) -> None:
    """An index of 100,000 nested msgpack arrays, its checksum re-signed in the manifest."""
    write_steps(tmp_path, [1, 2])
    step2 = tmp_path / "nvme" / "step-2"
    deep = b"\x91" * 100_000 + b"\xc0"
    (step2 / "rank-00000.index").write_bytes(deep)
    _forge(step2, lambda body: body["indexes"].update({"rank-00000.index": checksum(deep)}))
    _refused_everywhere(tmp_path, 2, "rank-00000.index")


def test_an_index_with_an_extra_field_fails_verify_migrate_a_conversion_and_restore(tmp_path: Path) -> None:
    """The index re-encoded with one extra nested field, its checksum re-signed: every reader refuses the
    copy, a conversion too (it writes indexes of its own, so it checks the source's first)."""
    write_steps(tmp_path, [1, 2])
    step2 = tmp_path / "nvme" / "step-2"
    doc = msgpack.unpackb((step2 / "rank-00000.index").read_bytes(), raw=False)
    next(item for item in doc["items"].values() if item.get("pieces"))["pieces"][0]["extra"] = {"nested": 1}
    forged = msgpack.packb(doc)
    (step2 / "rank-00000.index").write_bytes(forged)
    _forge(step2, lambda body: body["indexes"].update({"rank-00000.index": checksum(forged)}))
    _refused_everywhere(tmp_path, 2, "rank-00000.index")
    converted = _cli_on_tiers(tmp_path, "migrate", "2", "--from", "nvme", "--to", "pfs", "--format", "hdf5")
    assert converted.returncode == 1 and "rank-00000.index" in converted.stdout + converted.stderr, converted
    assert not (tmp_path / "pfs" / "step-2").exists()
    with pytest.raises(TierstateError, match="rank-00000.index"):
        load(step2)
