"""Corruption: damaged checkpoints are detected, named by file and frame, and never loaded.

Steps 1-3 are committed; then step 3 is damaged on disk (a flipped bit, a truncated or missing data
file, an edited, flipped or garbage manifest). Restoring it must fail with an error naming the file
(and the frame, for data) and leave the live state untouched; ``fallback=True`` must restore step 2
instead, bit-exact, and say why; an intact copy of step 3 on another tier must be used as is.
Random bit flips anywhere then show the stronger claim: a restore either fails or loads exactly
the bytes that were checkpointed (a flip in alignment padding is harmless by construction).
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from faultkit import scaled, state_matches, tally, tiers_of, trainer, write_steps
from tierstate.pipeline.restore import NoCheckpointError
from tierstate.tiers.format.format import read_manifest
from tierstate.tiers.format.manifest import MANIFEST_NAME
from tierstate.tiers.ops.migrate import migrate
from tierstate.tiers.ops.verify import verify_step

pytestmark = pytest.mark.faults

DATA = "rank-00000.data"
Corruption = Callable[[Path], str]  # damages a checkpoint directory; returns what the error must name


def _flip_bit_in_frame(directory: Path) -> str:
    frame = read_manifest(directory).files[DATA].frames[2]
    _flip(directory / DATA, frame.offset + frame.length // 2, 3)
    return f"{DATA} frame 2: checksum mismatch"


def _truncate_data(directory: Path) -> str:
    """The file cut in the middle of the frame that ends it (whichever that is: small frames too)."""
    frames = read_manifest(directory).files[DATA].frames
    last = max(range(len(frames)), key=lambda i: frames[i].offset)
    os.truncate(directory / DATA, frames[last].offset + frames[last].length // 2)
    return f"{DATA} frame {last}: truncated"


def _delete_data(directory: Path) -> str:
    (directory / DATA).unlink()
    return f"{DATA}: missing"


def _edit_manifest(directory: Path) -> str:
    """A hand edit that keeps the JSON valid: a frame moved by one alignment unit."""
    doc = json.loads((directory / MANIFEST_NAME).read_bytes())
    doc["manifest"]["files"][DATA]["frames"][1]["offset"] += 4096
    (directory / MANIFEST_NAME).write_text(json.dumps(doc))
    return f"{MANIFEST_NAME}: manifest checksum mismatch"


def _flip_bit_in_manifest(directory: Path) -> str:
    raw = (directory / MANIFEST_NAME).read_bytes()
    _flip(directory / MANIFEST_NAME, raw.index(b'"checksum"') + 1, 0)
    return MANIFEST_NAME


def _garbage_manifest(directory: Path) -> str:
    (directory / MANIFEST_NAME).write_bytes(b"\x00\xff not json")
    return f"{MANIFEST_NAME}: not valid JSON"


CORRUPTIONS: dict[str, Corruption] = {
    "flipped data bit": _flip_bit_in_frame,
    "truncated data file": _truncate_data,
    "missing data file": _delete_data,
    "edited manifest": _edit_manifest,
    "flipped manifest bit": _flip_bit_in_manifest,
    "garbage manifest": _garbage_manifest,
}


def _flip(path: Path, offset: int, bit: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ (1 << bit)]))


@pytest.fixture
def three_steps(tmp_path: Path) -> Path:
    write_steps(tmp_path, range(1, 4))
    return tmp_path


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corruption_is_detected_named_and_not_loaded(three_steps: Path, kind: str, caplog) -> None:
    named = CORRUPTIONS[kind](tiers_of(three_steps)[0].step_dir(3))
    with trainer(three_steps) as (runner, state):
        with pytest.raises(NoCheckpointError, match="cannot restore step 3") as failure:
            runner.restore("latest")
    assert named in str(failure.value) and named in caplog.text
    assert state_matches(state, 0), "a failed restore changed the live state"
    verified = verify_step(tiers_of(three_steps)[0], 3)
    assert not verified.ok and any(named.split(":")[0] in str(p) for p in verified.problems)
    tally("corruption_detected", faults=1, losses=0)


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_fallback_restores_the_newest_good_older_step(three_steps: Path, kind: str, caplog) -> None:
    named = CORRUPTIONS[kind](tiers_of(three_steps)[0].step_dir(3))
    caplog.set_level(logging.WARNING, logger="tierstate")
    with trainer(three_steps) as (runner, state):
        result = runner.restore("latest", fallback=True)
    assert result.step == 2 and state_matches(state, 2)
    assert any(named in problem for problem in result.problems)
    assert "fell back to step 2" in caplog.text
    tally("corruption_fallback", faults=1, losses=0)


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_another_tiers_copy_of_the_same_step_is_used(three_steps: Path, kind: str) -> None:
    nvme, pfs = tiers_of(three_steps)
    migrate(3, nvme, pfs)
    named = CORRUPTIONS[kind](nvme.step_dir(3))
    with trainer(three_steps) as (runner, state):
        result = runner.restore("latest")  # no fallback needed: the same step, verified, from pfs
    assert (result.step, result.tier) == (3, "pfs") and state_matches(state, 3)
    assert any(named in problem and "nvme" in problem for problem in result.problems)
    tally("corruption_other_tier", faults=1, losses=0)


def test_everything_on_every_tier_damaged_is_an_error_not_a_load(three_steps: Path) -> None:
    for tier in tiers_of(three_steps)[:1]:
        for step in tier.steps():
            _flip_bit_in_frame(tier.step_dir(step))
    with trainer(three_steps) as (runner, state):
        with pytest.raises(NoCheckpointError, match="or any older step") as failure:
            runner.restore("latest", fallback=True)
    assert all(f"step {s} on tier nvme" in str(failure.value) for s in (1, 2, 3))
    assert state_matches(state, 0)


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_random_bit_flips_are_detected_or_harmless(tmp_path: Path, codec: str) -> None:
    """Any single flipped bit, in data or manifest: the restore fails, or loads exactly step 1."""
    write_steps(tmp_path, [1], pipeline__stages__compress__codec=codec)
    directory = tiers_of(tmp_path)[0].step_dir(1)
    if codec == "zstd":
        assert any(f.codec == "zstd" for f in read_manifest(directory).files[DATA].frames)
    files = {name: (directory / name).read_bytes() for name in (DATA, MANIFEST_NAME)}
    rng = random.Random(codec)
    detected = harmless = 0
    with trainer(tmp_path) as (runner, state):
        for _ in range(scaled(60)):
            name = rng.choice(sorted(files))
            _flip(directory / name, rng.randrange(len(files[name])), rng.randrange(8))
            state.advance(0)
            try:
                runner.restore(1)
            except NoCheckpointError:
                detected += 1
                assert state_matches(state, 0)
            else:
                harmless += 1
                assert state_matches(state, 1), f"a flipped bit in {name} was loaded silently"
            (directory / name).write_bytes(files[name])
    assert detected > harmless  # padding is a small part of the file: most flips hit checksummed bytes
    tally("random_flips", faults=detected + harmless, detected=detected, harmless=harmless, losses=0)


@pytest.mark.parametrize("damage", ["missing", "flipped"])
def test_a_damaged_index_is_found_by_verify_and_refused_by_restore(three_steps: Path, damage: str) -> None:
    """The manifest has all that restore reads, but a copy verify rejects is one restore rejects too
    (tiers/reading/integrity.py): the newest step is refused naming the index, and fallback restores step 2."""
    nvme = tiers_of(three_steps)[0]
    index = nvme.step_dir(3) / "rank-00000.index"
    if damage == "missing":
        index.unlink()
    else:
        _flip(index, 5, 1)
    problems = [str(p) for p in verify_step(nvme, 3).problems]
    expected = "missing" if damage == "missing" else "checksum mismatch"
    assert len(problems) == 1 and problems[0].startswith("rank-00000.index: " + expected)
    with trainer(three_steps) as (runner, state):
        with pytest.raises(NoCheckpointError, match="rank-00000.index: " + expected):
            runner.restore("latest")
        result = runner.restore("latest", fallback=True)
        assert result.step == 2 and state_matches(state, 2) and "rank-00000.index" in result.problems[0]
