"""Hostile files in a tier: symlinks and FIFOs planted under checkpoint names, a lost manifest.

A tier directory may be shared, so anything in it may have been planted. Nothing tierstate does may
follow a symlink out of the tier (no write through it, no read of what it names, not even a checksum
of it in a report) or open a FIFO (which blocks forever): the runner's writes, a background flush,
and every CLI command. A ``step-N`` directory that lost its manifest must not vanish either: it is
listed as invalid, named by verify and by restore, and kept by gc as the evidence of a lost step.

Every test plants the files by hand in checkpoints a real runner wrote; the commands that could
hang run as child processes under a timeout, so a regression fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from faultkit import REPO, state_matches, tally, tiers_of, trainer, write_steps
from tierstate import cli
from tierstate.pipeline.restore import NoCheckpointError
from tierstate.tiers.format.manifest import MANIFEST_NAME
from tierstate.tiers.ops.verify import STAMP_NAME

pytestmark = pytest.mark.faults

DATA = "rank-00000.data"
INDEX = "rank-00000.index"
PRECIOUS = b"someone else's file: never to be written, read or hashed by tierstate\n"
HANG_LIMIT_S = 120  # a command that opens a FIFO blocks forever; a healthy one takes a few seconds


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the tiers holding a file that planted symlinks point at."""
    directory = tmp_path / "outside"
    directory.mkdir()
    (directory / "precious").write_bytes(PRECIOUS)
    return directory


def _tier_options(root: Path) -> list[str]:
    return [f"--tier={t.name}={t.root}" for t in tiers_of(root)]


def _cli(capsys: pytest.CaptureFixture[str], root: Path, *args: str) -> tuple[int, str]:
    """Run ``tierstate ARGS`` on ``root``'s tiers in-process: exit code and stdout + stderr."""
    capsys.readouterr()
    code = cli.main([*args, *_tier_options(root)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _listed(capsys: pytest.CaptureFixture[str], root: Path) -> list[dict]:
    """``tierstate ls --json`` on ``root``'s tiers: the parsed document on stdout (notes go to stderr)."""
    capsys.readouterr()
    assert cli.main(["ls", "--json", *_tier_options(root)]) == 0
    return json.loads(capsys.readouterr().out)


def _untouched(outside: Path) -> bool:
    return sorted(p.name for p in outside.iterdir()) == ["precious"] and (outside / "precious").read_bytes() == PRECIOUS


def test_verify_never_writes_its_stamp_through_a_planted_symlink(tmp_path: Path, outside: Path, capsys) -> None:
    write_steps(tmp_path, [1])
    step_dir = tiers_of(tmp_path)[0].step_dir(1)
    (step_dir / f"{STAMP_NAME}.tmp").symlink_to(outside / "precious")
    code, out = _cli(capsys, tmp_path, "verify")
    assert code == 0, out
    assert _untouched(outside)
    assert (step_dir / STAMP_NAME).is_file() and not (step_dir / STAMP_NAME).is_symlink()
    assert not os.path.lexists(step_dir / f"{STAMP_NAME}.tmp")

    # A symlink under the stamp's own name: refused and named, removed by name, never written through.
    (step_dir / STAMP_NAME).unlink()
    (step_dir / STAMP_NAME).symlink_to(outside / "precious")
    code, out = _cli(capsys, tmp_path, "verify")
    assert code == 1 and f"{STAMP_NAME}: is a symlink" in out, out
    assert _untouched(outside) and not os.path.lexists(step_dir / STAMP_NAME)
    assert _cli(capsys, tmp_path, "verify")[0] == 0
    tally("verify_stamp_symlink", faults=2, losses=0)


def test_migrate_never_writes_through_a_planted_data_file(tmp_path: Path, outside: Path, capsys) -> None:
    write_steps(tmp_path, [1])
    pfs = tiers_of(tmp_path)[1]
    pfs.partial_dir(1).mkdir(parents=True)
    (pfs.partial_dir(1) / DATA).symlink_to(outside / "precious")
    code, out = _cli(capsys, tmp_path, "migrate", "1", "--from", "nvme", "--to", "pfs")
    assert code == 1 and f"{pfs.partial_dir(1) / DATA}: is a symlink" in out, out
    assert _untouched(outside) and pfs.steps() == []

    # A planted partial directory (a symlink to a directory elsewhere) is refused the same way.
    for entry in pfs.partial_dir(1).iterdir():  # the planted link, and the index migrate copies first
        os.unlink(entry)
    pfs.partial_dir(1).rmdir()
    pfs.partial_dir(1).symlink_to(outside)
    code, out = _cli(capsys, tmp_path, "migrate", "1", "--from", "nvme", "--to", "pfs")
    assert code == 1 and f"{pfs.partial_dir(1)}: is a symlink, not a directory" in out, out
    assert _untouched(outside) and pfs.steps() == []
    tally("migrate_planted", faults=2, losses=0)


def test_a_background_flush_never_writes_through_a_planted_data_file(tmp_path: Path, outside: Path) -> None:
    pfs = tiers_of(tmp_path)[1]
    pfs.partial_dir(2).mkdir(parents=True)
    (pfs.partial_dir(2) / DATA).symlink_to(outside / "precious")
    flushed = {"path": str(pfs.root), "flush": {"every": 1}}
    with trainer(tmp_path, tiers__pfs=flushed) as (runner, state):
        handles = []
        for step in (1, 2, 3):
            state.advance(step)
            handles.append(runner.checkpoint(step))
            handles[-1].result()
    # Closing the runner drained its flushes.
    assert _untouched(outside)
    assert pfs.steps() == [1, 3] and tiers_of(tmp_path)[0].steps() == [1, 2, 3]
    error = handles[1].flush_errors["pfs"]
    assert f"{pfs.partial_dir(2) / DATA}: is a symlink" in str(error), error
    tally("flush_planted", faults=1, losses=0)


@pytest.mark.parametrize("name", [DATA, INDEX, MANIFEST_NAME])
def test_symlinked_checkpoint_files_are_never_read(tmp_path: Path, outside: Path, capsys, name: str) -> None:
    """Step 2's file ``name`` replaced by a symlink to a file outside: for data, step 1's data file
    (whose checksums differ: a read would report the outside file's hash); for the index and the
    manifest, the very bytes that were there (a read would pass)."""
    write_steps(tmp_path, [1, 2])
    nvme = tiers_of(tmp_path)[0]
    source = nvme.step_dir(1 if name == DATA else 2) / name
    planted = outside / f"copy-of-{name}"
    planted.write_bytes(source.read_bytes())
    (nvme.step_dir(2) / name).unlink()
    (nvme.step_dir(2) / name).symlink_to(planted)

    code, out = _cli(capsys, tmp_path, "verify")
    assert code == 1 and f"{name}: is a symlink" in out, out
    assert xxhash.xxh3_64_hexdigest(planted.read_bytes()) not in out and "checksum mismatch" not in out, out
    listed = {entry["step"]: entry for entry in _listed(capsys, tmp_path)}
    assert listed[2]["state"] == ("invalid" if name == MANIFEST_NAME else "damaged"), listed[2]  # as verify found it

    with trainer(tmp_path) as (runner, state):  # a copy verify refuses, restore refuses (the index too)
        with pytest.raises(NoCheckpointError, match=f"{name}: is a symlink"):
            runner.restore(2)
        result = runner.restore("latest", fallback=True)
        assert result.step == 1 and state_matches(state, 1)
        assert any("step 2 on tier nvme" in p and f"{name}: is a symlink" in p for p in result.problems)
    assert (outside / "precious").read_bytes() == PRECIOUS
    tally("symlinked_file", faults=1, losses=0)


def _run_cli(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m tierstate ARGS`` in a child process that must finish within HANG_LIMIT_S."""
    command = [sys.executable, "-m", "tierstate", *args, *_tier_options(root)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=HANG_LIMIT_S)


def test_fifos_named_like_checkpoint_files_hang_no_command(tmp_path: Path) -> None:
    """A FIFO as step 1's stamp, step 2's data file and step 3's manifest: ls, verify and migrate
    finish (a FIFO is never opened), each naming what it refused."""
    write_steps(tmp_path, [1, 2, 3])
    nvme = tiers_of(tmp_path)[0]
    for step, name in ((1, STAMP_NAME), (2, DATA), (3, MANIFEST_NAME)):
        (nvme.step_dir(step) / name).unlink(missing_ok=True)
        os.mkfifo(nvme.step_dir(step) / name)

    listed = _run_cli(tmp_path, "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    states = {e["step"]: e["state"] for e in json.loads(listed.stdout)}
    assert states == {1: "committed", 2: "committed", 3: "invalid"}
    verified = _run_cli(tmp_path, "verify")
    assert verified.returncode == 1 and f"{DATA}: is a FIFO" in verified.stdout, verified.stdout + verified.stderr
    assert f"nvme step 3: FAILED\n  {MANIFEST_NAME}: is a FIFO" in verified.stdout, verified.stdout
    migrated = _run_cli(tmp_path, "migrate", "--all", "--from", "nvme", "--to", "pfs")
    assert migrated.returncode == 1 and f"{DATA}: is a FIFO" in migrated.stdout, migrated.stdout + migrated.stderr
    assert tiers_of(tmp_path)[1].steps() == [1]
    tally("fifos", faults=3, losses=0)


def test_gc_leaves_symlinks_named_like_checkpoints_alone(tmp_path: Path, outside: Path, capsys) -> None:
    write_steps(tmp_path, [1])
    nvme = tiers_of(tmp_path)[0]
    for name in ("step-7", "step-8.deleting", "step-9.partial"):
        (nvme.root / name).symlink_to(outside)
    code, out = _cli(capsys, tmp_path, "gc", "--older-than", "0")
    assert code == 0, out
    for name in ("step-7", "step-8.deleting", "step-9.partial"):
        assert f"nvme {name}: invalid, kept: {name}: is a symlink, not a directory; never followed" in out, out
        assert (nvme.root / name).is_symlink()
    assert "rmtree" not in out and _untouched(outside)
    assert [(e["step"], e["state"]) for e in _listed(capsys, tmp_path)] == [
        (1, "committed"), (7, "invalid"), ("step-8.deleting", "invalid"), ("step-9.partial", "invalid")
    ]  # fmt: skip
    tally("gc_symlinks", faults=3, losses=0)


def test_a_lost_manifest_is_named_everywhere_and_kept(tmp_path: Path, capsys) -> None:
    """Step 2's manifest deleted: ls lists it invalid, verify fails naming it, gc keeps it, and a
    restore of the latest step is refused naming it, as a damaged manifest of the newest step is;
    with fallback=True it takes step 1, saying why."""
    write_steps(tmp_path, [1, 2])
    nvme = tiers_of(tmp_path)[0]
    (nvme.step_dir(2) / MANIFEST_NAME).unlink()

    entries = {e["step"]: e for e in _listed(capsys, tmp_path)}
    assert entries[2]["state"] == "invalid" and "manifest.json: missing" in entries[2]["error"]
    code, out = _cli(capsys, tmp_path, "verify")
    assert code == 1 and "nvme step 1: ok" in out and "nvme step 2: FAILED\n  manifest.json: missing" in out, out
    code, out = _cli(capsys, tmp_path, "gc", "--older-than", "0")
    assert code == 0 and "nvme step-2: invalid, kept: manifest.json: missing" in out, out
    assert (nvme.step_dir(2) / DATA).is_file()

    with trainer(tmp_path) as (runner, state):
        with pytest.raises(NoCheckpointError, match=r"latest step: step 2 on tier nvme: not a checkpoint: manif"):
            runner.restore("latest")
        result = runner.restore("latest", fallback=True)
        assert result.step == 1 and state_matches(state, 1)
        assert len(result.problems) == 1 and result.problems[0].startswith(
            "step 2 on tier nvme: not a checkpoint: manifest.json: missing"
        ), result.problems
        with pytest.raises(NoCheckpointError, match="step 2 on tier nvme: not a checkpoint: manifest.json: missing"):
            runner.restore(2)
    tally("lost_manifest", faults=1, losses=0)
