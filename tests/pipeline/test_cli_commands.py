"""What the commands do for the person running them: prune asks and says what it frees, export never
clobbers and writes ordinary files, Ctrl-C stops migrate cleanly, ls remembers a damaged copy, and
migrate --format honours --bandwidth and converts a copy held in the other format."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_cli import _on_terminal

from tierstate import cli
from tierstate.cli import commands, render
from tierstate.providers import TensorDictProvider
from tierstate.tiers.format.convert import container_format
from tierstate.tiers.ops.migrate import migrate
from tierstate.tiers.ops.pacing import Pacer
from tierstate.tiers.ops.policy import RetentionPolicy
from tierstate.tiers.ops.retention import TierPolicies
from tierstate.tiers.reading.stored import load
from tierstate.tiers.storage import faults
from tierstate.tiers.storage.filesystem import FilesystemTier

MiB = 1 << 20


@pytest.fixture
def nvme(make_runner, tmp_path) -> FilesystemTier:
    """Steps 1-3 committed on nvme, 4 MiB of float32 each in 1 MiB frames."""
    runner = make_runner(chunk_size="1MiB", host_cache__size="4MiB")
    state = {"w": torch.arange(MiB, dtype=torch.float32)}
    runner.register(t=TensorDictProvider(state))
    for step in (1, 2, 3):
        state["w"].add_(1)
        runner.checkpoint(step).result()
    return FilesystemTier("nvme", tmp_path / "nvme")


def _du(directory: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in directory.iterdir())


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB"


# --- prune --------------------------------------------------------------------------------------
def test_prune_says_what_it_would_free_and_what_it_freed(nvme, capsys):
    sizes = {step: _du(nvme.step_dir(step)) for step in (1, 2, 3)}
    tier = ["--tier", f"nvme={nvme.root}"]
    assert cli.main(["prune", "--keep-last", "1", "--dry-run", *tier]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"nvme step 1: would delete {_mb(sizes[1])} (not kept by keep_last=1)",
        f"nvme step 2: would delete {_mb(sizes[2])} (not kept by keep_last=1)",
        "nvme step 3: kept (keep_last=1)",
        f"would free {_mb(sizes[1] + sizes[2])} in all",
    ]
    assert cli.main(["prune", "--keep-last", "2", *tier]) == 0  # not a terminal: no question, as scripts expect
    assert capsys.readouterr().out.splitlines()[0] == f"nvme step 1: deleted {_mb(sizes[1])} (not kept by keep_last=2)"
    assert nvme.steps() == [2, 3]


def test_prune_asks_first_and_deletes_nothing_unless_told_yes(nvme):
    plans: list[commands.Pruning] = []

    def answer(yes: bool):
        def confirm(plan: commands.Pruning) -> bool:
            plans.append(plan)
            return yes

        return confirm

    policies = [TierPolicies(nvme, RetentionPolicy(keep_last=1))]
    total = _du(nvme.step_dir(1)) + _du(nvme.step_dir(2))
    declined = commands.prune_tiers(policies, {"nvme"}, confirm=answer(False))
    assert declined.declined and declined.decisions == [] and nvme.steps() == [1, 2, 3]
    [plan] = plans
    assert plan.dry_run and [d.step for d in plan.doomed] == [1, 2] and plan.freed == total
    assert render.prune_question(plan) == f"delete 2 checkpoints, freeing {_mb(total)}? [y/N] "
    done = commands.prune_tiers(policies, {"nvme"}, confirm=answer(True))
    assert not done.dry_run and [d.step for d in done.doomed] == [1, 2] and done.freed == total
    assert nvme.steps() == [3]
    nothing = commands.prune_tiers(policies, {"nvme"}, confirm=answer(True))
    assert len(plans) == 2 and nothing.doomed == []  # nothing left to delete: nothing asked


def test_prune_on_a_terminal_asks_and_yes_skips_the_question(nvme):
    tier = ["--tier", f"nvme={nvme.root}"]
    code, shown = _on_terminal(["prune", "--keep-last", "2", *tier], answer="n")
    assert code == 0 and "nvme step 1: would delete" in shown
    assert "delete 1 checkpoint, freeing" in shown and shown.rstrip().endswith("nothing deleted")
    assert nvme.steps() == [1, 2, 3]
    code, shown = _on_terminal(["prune", "--keep-last", "2", "--yes", *tier])
    assert code == 0 and "[y/N]" not in shown and "nvme step 1: deleted" in shown
    assert nvme.steps() == [2, 3]


# --- export -------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["hdf5", "safetensors"])
def test_export_writes_an_ordinary_file_and_never_overwrites_unasked(nvme, tmp_path, capsys, fmt):
    out = tmp_path / "out" / f"step.{fmt}"
    args = ["export", "3", str(out), "--format", fmt, "--tier", f"nvme={nvme.root}"]
    previous = os.umask(0o027)
    try:
        assert cli.main(args) == 0
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == 0o640  # 0666 less the umask, as any new file
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temporary left beside it
    capsys.readouterr()
    out.write_bytes(b"precious")
    assert cli.main(args) == 2
    assert capsys.readouterr().err == f"tierstate: {out} exists; give --force to replace it\n"
    assert out.read_bytes() == b"precious"
    assert cli.main([*args, "--force"]) == 0
    if fmt == "safetensors":
        assert torch.equal(load_file(str(out))["t/w"], load(nvme.step_dir(3))["t/w"])
    else:
        assert out.read_bytes()[:8] == b"\x89HDF\r\n\x1a\n"


# --- migrate ------------------------------------------------------------------------------------
def test_ctrl_c_during_migrate_says_what_was_published_exits_130_and_the_next_run_resumes(nvme, tmp_path, capsys):
    pfs = FilesystemTier("pfs", tmp_path / "pfs")
    args = ["migrate", "3", "--from", "nvme", "--to", "pfs", "--tier", f"nvme={nvme.root}", "--tier", f"pfs={pfs.root}"]
    copied = []

    def press_ctrl_c(path: Path | None) -> None:
        copied.append(path)
        if len(copied) == 2:  # a real SIGINT, as the terminal sends it: Python raises KeyboardInterrupt
            # Raised in this (the main) thread: os.kill may deliver it to any other thread of the process.
            signal.raise_signal(signal.SIGINT)

    # What a terminal's Ctrl-C meets in a plain CLI process, whatever an earlier test left installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with faults.inject("migrate.frame", press_ctrl_c):
            assert cli.main(args) == 130, f"SIGINT handler before the test: {previous!r}"
    finally:
        signal.signal(signal.SIGINT, previous)
    out, err = capsys.readouterr()
    said = "tierstate migrate: interrupted; nothing published before it; the step being copied was not published "
    assert err == said + "(the same command again resumes it)\n" and out == ""
    assert pfs.steps() == [] and pfs.partial_dir(3).is_dir()
    assert cli.main([*args, "--json"]) == 0
    assert '"frames_reused": 2' in capsys.readouterr().out
    assert torch.equal(load(pfs.step_dir(3))["t/w"], load(nvme.step_dir(3))["t/w"])


def test_format_conversion_honours_bandwidth_and_slow_copies_say_mb_per_s(nvme, tmp_path, capsys):
    pfs = FilesystemTier("pfs", tmp_path / "pfs")
    rate = 8 * MiB
    report = migrate(2, nvme, pfs, fmt="hdf5", pacer=Pacer(rate))
    assert report.outcome == "converted" and report.seconds >= report.bytes_copied / rate
    tiers = ["--tier", f"nvme={nvme.root}", "--tier", f"pfs={pfs.root}"]
    assert cli.main(["migrate", "3", "--from", "nvme", "--to", "pfs", "--format", "hdf5", "--bandwidth", "8MiB",
                     *tiers]) == 0  # fmt: skip
    line = capsys.readouterr().out.strip()
    assert line.startswith("step 3: nvme -> pfs: converted") and line.endswith("MB/s), verified, published")
    seconds = float(line.split(" in ")[1].split(" s ")[0])
    assert seconds >= pfs.manifest(3).stored_bytes / (8 * MiB) * 0.95  # printed to 2 decimals


def test_migrate_format_converts_a_copy_the_target_holds_in_the_other_format(nvme, tmp_path, capsys):
    pfs = FilesystemTier("pfs", tmp_path / "pfs")
    migrate(3, nvme, pfs)
    assert container_format(pfs.manifest(3), "pfs") == "frames"
    tiers = ["--tier", f"nvme={nvme.root}", "--tier", f"pfs={pfs.root}"]
    assert cli.main(["migrate", "3", "--from", "nvme", "--to", "pfs", *tiers]) == 0
    assert "already there" in capsys.readouterr().out  # no format asked for: the copy there will do
    assert cli.main(["migrate", "3", "--from", "nvme", "--to", "pfs", "--format", "hdf5", *tiers]) == 0
    assert "step 3: nvme -> pfs: converted" in capsys.readouterr().out
    assert container_format(pfs.manifest(3), "pfs") == "hdf5" and pfs.steps() == [3]
    assert sorted(p.name for p in pfs.root.iterdir()) == ["step-3"]  # the frames copy is gone, no leftovers
    assert torch.equal(load(pfs.step_dir(3))["t/w"], load(nvme.step_dir(3))["t/w"])
    assert cli.main(["migrate", "3", "--from", "nvme", "--to", "pfs", "--format", "hdf5", *tiers]) == 0
    assert "already there" in capsys.readouterr().out
    assert cli.main(["migrate", "3", "--from", "nvme", "--to", "pfs", "--format", "zip", *tiers]) == 2
    assert "tierstate: --format 'zip': expected one of frames, hdf5" in capsys.readouterr().err


# --- ls after verify ----------------------------------------------------------------------------
def test_a_copy_verify_found_damaged_stays_damaged_until_verified_clean(nvme, capsys):
    tier = ["--tier", f"nvme={nvme.root}"]
    data = nvme.step_dir(2) / "rank-00000.data"
    frame = nvme.manifest(2).files["rank-00000.data"].frames[0]

    def flip() -> None:
        with open(data, "r+b") as handle:
            handle.seek(frame.offset + frame.length // 2)
            byte = handle.read(1)
            handle.seek(frame.offset + frame.length // 2)
            handle.write(bytes([byte[0] ^ 0x01]))

    def states() -> dict[str, str]:
        assert cli.main(["ls", *tier]) == 0
        return {line.split()[1]: line.split()[2] for line in capsys.readouterr().out.splitlines()[1:]}

    assert states() == {"1": "committed", "2": "committed", "3": "committed"}
    flip()
    assert cli.main(["verify", "2", *tier]) == 1
    capsys.readouterr()
    assert states()["2"] == "damaged"
    assert cli.main(["verify", "1", *tier]) == 0  # verifying another step leaves the mark where it is
    capsys.readouterr()
    assert states() == {"1": "verified", "2": "damaged", "3": "committed"}
    flip()  # repaired (the bit flipped back)
    assert cli.main(["verify", "2", *tier]) == 0
    capsys.readouterr()
    assert states()["2"] == "verified"


# --- peer copies ----------------------------------------------------------------------------------
def test_ls_and_verify_show_the_peer_copies_a_node_tier_holds_and_never_follow_a_symlink(nvme, tmp_path, capsys):
    import json
    import shutil

    shutil.copytree(nvme.step_dir(2), nvme.root / "peer-n1" / "step-2")  # n1's part, kept here
    shutil.copytree(nvme.step_dir(3), nvme.root / "from-peer-n1" / "step-3")  # this node's part, sent back
    planted = tmp_path / "elsewhere"
    shutil.copytree(nvme.step_dir(1), planted / "step-1")
    (nvme.root / "peer-evil").symlink_to(planted, target_is_directory=True)
    tier = ["--tier", f"nvme={nvme.root}"]

    assert cli.main(["ls", "--json", *tier]) == 0
    listed = [(e["tier"], e["step"], e["state"]) for e in json.loads(capsys.readouterr().out)]
    assert listed == [
        ("nvme", 1, "committed"), ("nvme", 2, "committed"), ("nvme", 3, "committed"),
        ("nvme (peer n1)", 3, "committed"), ("nvme (copy of n1)", 2, "committed"),
    ]  # fmt: skip

    data = next(p for p in (nvme.root / "peer-n1" / "step-2").iterdir() if p.name.endswith(".data"))
    with data.open("r+b") as f:  # one byte of the peer copy flipped
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    assert cli.main(["verify", *tier]) == 1
    out = capsys.readouterr().out
    assert "nvme (copy of n1) step 2: FAILED" in out and "nvme (peer n1) step 3: ok" in out
    assert "nvme step 2: ok" in out and "evil" not in out
