"""Migration between tiers: resumable after SIGKILL, idempotent, verified, never half-published."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import REPO
from tierstate import cli
from tierstate.providers import ObjectProvider, TensorDictProvider
from tierstate.tiers.format.format import ManifestError
from tierstate.tiers.ops.migrate import MigrateError, migrate
from tierstate.tiers.ops.pacing import Pacer
from tierstate.tiers.ops.verify import verify_step
from tierstate.tiers.reading.stored import CorruptCheckpointError, load
from tierstate.tiers.storage.filesystem import FilesystemTier

MiB = 1 << 20


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(5 * MiB // 4, generator=gen),  # 5 frames of 1 MiB
        "bf16": torch.randn(64, 33, generator=gen).to(torch.bfloat16),
        "step": torch.tensor(7),
    }


@pytest.fixture
def tiers(make_runner, tmp_path):
    """Two committed checkpoints (steps 3, 4) on nvme in 1 MiB frames; the tiers, and step 4's state."""
    runner = make_runner(chunk_size="1MiB", host_cache__size="4MiB")
    state = _state()
    runner.register(t=TensorDictProvider(state), meta=ObjectProvider({"epoch": 2}))
    runner.checkpoint(3).result()
    state["big"].add_(1)
    runner.checkpoint(4).result()
    runner.close()
    expected = {f"t/{k}": v.clone() for k, v in state.items()}
    return FilesystemTier("nvme", tmp_path / "nvme"), FilesystemTier("pfs", tmp_path / "pfs"), expected


def _same(loaded: dict, expected: dict) -> bool:
    return all(
        torch.equal(loaded[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
        for k, v in expected.items()
    )


def _tierstate(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The real CLI in its own process (``python -m tierstate``), as a user or a script runs it."""
    command = [sys.executable, "-m", "tierstate", *args, "--tier", f"nvme={tmp_path / 'nvme'}"]
    command += ["--tier", f"pfs={tmp_path / 'pfs'}"]
    return subprocess.run(command, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True)


def test_migrate_killed_then_resumed_copies_nothing_twice(tiers, tmp_path):
    nvme, pfs, expected = tiers
    frames = len(nvme.manifest(4).files["rank-00000.data"].frames)
    assert frames >= 6
    killed = _tierstate(
        tmp_path, "migrate", "4", "--from", "nvme", "--to", "pfs", env={"TIERSTATE_FAULT": "migrate.frame@3"}
    )
    assert killed.returncode == -9, killed.stderr  # really SIGKILLed, after its 3rd frame was copied and verified
    # Half copied: the target lists nothing, and ls says so.
    assert pfs.steps() == [] and pfs.partial_dir(4).is_dir()
    listed = json.loads(_tierstate(tmp_path, "ls", "--json").stdout)
    assert [(e["tier"], e["step"], e["state"]) for e in listed if e["tier"] == "pfs"] == [
        ("pfs", "step-4.partial", "partial")
    ]
    with pytest.raises(ManifestError, match="no manifest"):
        load(pfs.step_dir(4))

    resumed = _tierstate(tmp_path, "migrate", "4", "--from", "nvme", "--to", "pfs", "--json")
    assert resumed.returncode == 0, resumed.stderr
    [report] = json.loads(resumed.stdout)
    assert (report["frames"], report["frames_reused"], report["frames_copied"]) == (frames, 3, frames - 3)
    first_three = sum(f.length for f in nvme.manifest(4).files["rank-00000.data"].frames[:3])
    assert report["bytes_reused"] == first_three
    assert pfs.steps() == [4] and not pfs.partial_dir(4).exists()
    assert verify_step(pfs, 4).ok and _same(load(pfs.step_dir(4)), expected)

    again = migrate(4, nvme, pfs)  # idempotent: nothing to do
    assert again.outcome == "already there" and again.bytes_copied == 0


def test_resume_recopies_a_frame_damaged_in_the_partial_copy(tiers, tmp_path):
    nvme, pfs, expected = tiers
    killed = _tierstate(
        tmp_path, "migrate", "4", "--from", "nvme", "--to", "pfs", env={"TIERSTATE_FAULT": "migrate.frame@3"}
    )
    assert killed.returncode == -9
    data = pfs.partial_dir(4) / "rank-00000.data"
    frame = nvme.manifest(4).files["rank-00000.data"].frames[1]
    with open(data, "r+b") as handle:
        handle.seek(frame.offset + frame.length // 2)
        byte = handle.read(1)
        handle.seek(frame.offset + frame.length // 2)
        handle.write(bytes([byte[0] ^ 0x40]))
    report = migrate(4, nvme, pfs)
    assert report.frames_reused == 2 and report.frames_copied == report.frames - 2
    assert _same(load(pfs.step_dir(4)), expected)


def test_move_publishes_verified_then_deletes_the_source(tiers, tmp_path, capsys):
    nvme, pfs, expected = tiers
    assert cli.main(["migrate", "--all", "--from", "nvme", "--to", "pfs", "--move", "--tier", f"nvme={nvme.root}",
                     "--tier", f"pfs={pfs.root}"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "step 3: nvme -> pfs: copied" in out and "source deleted" in out and "B/s)" in out
    assert nvme.steps() == [] and sorted(p.name for p in nvme.root.iterdir()) == []
    assert pfs.steps() == [3, 4] and _same(load(pfs.step_dir(4)), expected)


def test_a_corrupt_source_is_never_published(tiers, capsys):
    nvme, pfs, _ = tiers
    frame = nvme.manifest(3).files["rank-00000.data"].frames[2]
    data = nvme.step_dir(3) / "rank-00000.data"
    raw = bytearray(data.read_bytes())
    raw[frame.offset + 5] ^= 0xFF
    data.write_bytes(bytes(raw))
    mismatch = r"nvme/step-3/rank-00000.data frame 2: bytes \d+\.\.\d+: checksum mismatch"
    with pytest.raises(CorruptCheckpointError, match=mismatch):
        migrate(3, nvme, pfs)
    assert pfs.steps() == []
    tier_options = ["--tier", f"nvme={nvme.root}", "--tier", f"pfs={pfs.root}"]
    assert cli.main(["migrate", "3", "--from", "nvme", "--to", "pfs", *tier_options]) == 1
    assert "step 3: nvme -> pfs: FAILED" in capsys.readouterr().out


def test_format_changes_round_trip_through_hdf5(tiers, tmp_path):
    nvme, pfs, expected = tiers
    archive = FilesystemTier("archive", tmp_path / "archive")
    to_hdf5 = migrate(4, nvme, pfs, fmt="hdf5")
    assert to_hdf5.outcome == "converted" and sorted(os.listdir(pfs.step_dir(4)))[1:] == [
        "rank-00000.h5", "rank-00000.index", "verified.json"]  # fmt: skip
    back = migrate(4, pfs, archive, fmt="frames")
    assert back.outcome == "converted"
    for tier in (pfs, archive):
        state = load(tier.step_dir(4))
        assert _same(state, expected) and state["meta/value"] == {"epoch": 2}
        assert verify_step(tier, 4).ok
    assert migrate(4, nvme, pfs).outcome == "already there"  # the same checkpoint, in another format


def test_bad_input_is_named(tiers, capsys):
    nvme, pfs, _ = tiers
    tier_options = ["--tier", f"nvme={nvme.root}", "--tier", f"pfs={pfs.root}"]
    cases = {
        ("migrate", "4", "--from", "nvm", "--to", "pfs"): "--from nvm: no such tier; did you mean 'nvme'? (tiers: nv",
        ("migrate", "9", "--from", "nvme", "--to", "pfs"): "--from nvme: no committed checkpoint step 9",
        ("migrate", "4", "--from", "nvme", "--to", "nvme"): "--from and --to are both nvme",
        ("migrate", "--from", "nvme", "--to", "pfs"): "give either a STEP or --all",
        ("gc", "--older-than", "soon"): "--older-than 'soon': expected a duration",
        ("migrate", "4", "--from", "nvme", "--to", "pfs", "--bandwidth", "fast"): "--bandwidth 'fast'",
        ("verify", "9"): "step 9: no committed checkpoint on nvme, pfs",
        ("export", "9", "out.h5", "--format", "hdf5"): "step 9: no committed checkpoint on nvme, pfs",
        ("prune",): "no retention policy",
    }
    for args, message in cases.items():
        assert cli.main([*args, *tier_options]) == 2, args
        assert message in capsys.readouterr().err, args
    with pytest.raises(MigrateError, match="same directory"):
        migrate(4, nvme, FilesystemTier("again", nvme.root))


@pytest.fixture
def other_file_system(tmp_path):
    """A directory on another file system than tmp_path (tmpfs), where copy_file_range gives EXDEV."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on a file system of its own")
    directory = Path(tempfile.mkdtemp(dir=shm, prefix="tierstate-test-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def test_migrate_across_file_systems_copies_through_user_space(tiers, other_file_system):
    nvme, _, expected = tiers
    remote = FilesystemTier("remote", other_file_system / "tier")
    report = migrate(4, nvme, remote)
    assert report.frames_copied == report.frames and verify_step(remote, 4).ok
    assert _same(load(remote.step_dir(4)), expected)


def test_bandwidth_caps_the_copy_rate(tiers):
    nvme, pfs, _ = tiers
    rate = 32 << 20
    report = migrate(4, nvme, pfs, pacer=Pacer(rate))
    assert report.seconds >= report.bytes_copied / rate  # the pacer sleeps off every byte ahead of the budget
