"""The command line as a newcomer meets it: a bare ``tierstate`` helps, global options go before the command
too, every mistyped name gets a guess, ``flush`` shows each step and a bar and, interrupted, says what it
published; rates count the bytes moved; one unit style; ``trace`` writes the timeline."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from test_cli import _on_terminal, _tierstate

from tierstate import cli
from tierstate.cli import render
from tierstate.cli.parser import build_parser
from tierstate.providers import TensorDictProvider
from tierstate.tiers.ops.migrate import migrate
from tierstate.tiers.storage import faults
from tierstate.tiers.storage.filesystem import FilesystemTier

MiB = 1 << 20


@pytest.fixture
def tiered(make_runner, tmp_path) -> Path:
    """A config flushing nvme to pfs, with steps 1-3 committed on nvme and none flushed (a crashed run's
    tiers): 4 MiB of float32 per step, in 1 MiB frames."""
    runner = make_runner(chunk_size="1MiB", host_cache__size="4MiB")
    state = {"w": torch.arange(MiB, dtype=torch.float32)}
    runner.register(t=TensorDictProvider(state))
    for step in (1, 2, 3):
        state["w"].add_(1)
        runner.checkpoint(step).result()
    runner.close()
    (tmp_path / "pfs").mkdir()  # made by the run's first flush, which never happened
    config = {
        "tiers": {
            "nvme": {"path": str(tmp_path / "nvme"), "retention": {"keep_last": 3}},
            "pfs": {"path": str(tmp_path / "pfs"), "flush": {"every": 1}, "retention": {"keep_last": 3}},
        }
    }
    path = tmp_path / "tiered.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _frames(tier: FilesystemTier, step: int) -> int:
    return sum(len(record.frames) for record in tier.manifest(step).files.values())


# --- help, global options, guesses ---------------------------------------------------------------
def test_a_bare_tierstate_prints_the_full_help_as_git_does() -> None:
    done = _tierstate()
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout == _tierstate("--help").stdout
    for shown in ("COMMAND", "flush", "trace", "examples:", "tierstate ls --config tiered", "--config YAML"):
        assert shown in done.stdout, shown


def test_options_of_every_command_are_understood_before_it(tiered, tmp_path, capsys) -> None:
    """``tierstate --config tiered ls``, as git and docker take their global options; ``--tier`` given on
    both sides adds up; an option the command does not take is named."""
    assert cli.main(["--config", str(tiered), "ls"]) == 0
    before = capsys.readouterr().out
    assert cli.main(["ls", "--config", str(tiered)]) == 0
    assert capsys.readouterr().out == before and "nvme  3 " in before
    assert cli.main(["--tier", f"nvme={tmp_path / 'nvme'}", "--json", "ls", "--tier", f"pfs={tmp_path / 'pfs'}"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(e["tier"], e["step"]) for e in listed] == [("nvme", 1), ("nvme", 2), ("nvme", 3)]
    with pytest.raises(SystemExit) as refused:
        cli.main(["--config", str(tiered), "init", str(tmp_path)])
    assert refused.value.code == 2
    assert capsys.readouterr().err.endswith("tierstate init: error: --config is not an option of tierstate init\n")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["prune", "--dry-rn", "--tier", "nvme=x"],
         "tierstate prune: error: unrecognized arguments: --dry-rn; did you mean '--dry-run'?"),
        (["ls", "--jsn", "--confg=x"],
         "tierstate ls: error: unrecognized arguments: --jsn --confg=x; did you mean '--json' (not --jsn), "
         "'--config' (not --confg)?"),
        (["s3", "lss", "s3://b/p"],
         "tierstate s3: error: no s3 action 'lss'; did you mean 'ls'? (s3 actions: ls, verify, push, pull, prune, gc)"),
        (["trase", "1"],
         "tierstate: error: no command 'trase'; did you mean 'trace'? (commands: ls, inspect, stats, trace, migrate, "
         "verify, prune, flush, agent, s3, gc, export, import, init)"),
    ],
)  # fmt: skip
def test_mistyped_options_and_s3_actions_get_the_one_meant(argv, said) -> None:
    done = _tierstate(*argv)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines()[-1] == said


def test_mistyped_config_tier_and_format_names_get_the_one_meant(tiered, tmp_path, capsys) -> None:
    packaged = "cluster, compressed, default, tiered"
    assert cli.main(["ls", "--config", "tierd"]) == 2
    assert capsys.readouterr().err == (
        "tierstate: tierd: file not found; did you mean the packaged config 'tiered'? (packaged configs, by name: "
        f"{packaged}; `tierstate init` writes an editable copy)\n"
    )
    assert cli.main(["init", str(tmp_path), "--from", "clustr"]) == 2
    assert capsys.readouterr().err == (
        f"tierstate: --from 'clustr': no such packaged config; did you mean 'cluster'? (packaged: {packaged})\n"
    )
    assert cli.main(["migrate", "1", "--from", "nvm", "--to", "pfs", "--config", str(tiered)]) == 2
    assert capsys.readouterr().err == "tierstate: --from nvm: no such tier; did you mean 'nvme'? (tiers: nvme, pfs)\n"
    assert cli.main(["migrate", "1", "--from", "nvme", "--to", "pfs", "--format", "hdf", "--config", str(tiered)]) == 2
    expected = "tierstate: --format 'hdf': expected one of frames, hdf5; did you mean 'hdf5'?\n"
    assert capsys.readouterr().err == expected


def test_every_command_the_help_lists_is_one_the_parser_takes() -> None:
    commands = list(build_parser().chooser.choices)
    shown = _tierstate("--help").stdout
    assert all(re.search(rf"^    {name}\b", shown, re.M) for name in commands), shown


# --- trace ---------------------------------------------------------------------------------------
def test_trace_writes_the_timeline_stats_trace_writes(tiered, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["trace", "2", "--config", str(tiered)]) == 0
    said = capsys.readouterr().out
    assert re.fullmatch(r"trace: \d+ events in trace-step-2\.json \(open it in ui\.perfetto\.dev or chrome://tracing\)\n",
                        said), said  # fmt: skip
    assert cli.main(["stats", "2", "--config", str(tiered), "--trace", "stats.json"]) == 0
    capsys.readouterr()
    assert json.loads(Path("trace-step-2.json").read_text()) == json.loads(Path("stats.json").read_text())
    assert cli.main(["trace", str(tmp_path / "nvme" / "step-3"), "-o", "three.json"]) == 0
    assert "in three.json" in capsys.readouterr().out and Path("three.json").is_file()


# --- flush: each step as it ends, a bar, the truth after Ctrl-C ------------------------------------
FLUSH_LINE = (
    r"step {step}: nvme -> pfs: copied {n} of {n} frames, 4\.2 MB in \d+\.\d\d s \(\d+\.\d [kMG]B/s\), "
    r"verified, published"
)


@pytest.mark.slow  # a CLI process of its own, which loads torch
def test_flush_into_a_pipe_prints_a_plain_line_per_step_and_no_bar(tiered, tmp_path) -> None:
    frames = _frames(FilesystemTier("nvme", tmp_path / "nvme"), 1)
    done = subprocess.run([sys.executable, "-m", "tierstate", "flush", "--config", str(tiered)],
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0 and done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 3, lines
    for step, line in zip((1, 2, 3), lines, strict=True):
        assert re.fullmatch(FLUSH_LINE.format(step=step, n=frames), line), line
    assert FilesystemTier("pfs", tmp_path / "pfs").steps() == [1, 2, 3]


@pytest.mark.slow  # a CLI process of its own, which loads torch
def test_flush_on_a_terminal_draws_a_bar_in_the_units_of_its_lines(tiered, tmp_path) -> None:
    frames = _frames(FilesystemTier("nvme", tmp_path / "nvme"), 1)
    code, shown = _on_terminal(["flush", "--config", str(tiered)], columns=150)
    assert code == 0, shown
    for step in (1, 2, 3):
        assert re.search(FLUSH_LINE.format(step=step, n=frames), shown), shown
    assert re.search(r"\rflush .*━.* 12\.6/12\.6 MB ", shown), shown  # the bar, over the three steps


def test_ctrl_c_in_flush_says_which_steps_it_published(tiered, tmp_path, capsys) -> None:
    nvme, pfs = FilesystemTier("nvme", tmp_path / "nvme"), FilesystemTier("pfs", tmp_path / "pfs")
    frames = _frames(nvme, 1)
    copied = []

    def press_ctrl_c(_path: Path | None) -> None:
        copied.append(1)
        if len(copied) == frames + 2:  # step 1 published, step 2 half-way
            signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with faults.inject("migrate.frame", press_ctrl_c):
            assert cli.main(["flush", "--config", str(tiered)]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    out, err = capsys.readouterr()
    assert re.fullmatch(FLUSH_LINE.format(step=1, n=frames) + "\n", out), out
    assert err == (
        "tierstate flush: interrupted; published before it: step 1 on pfs; retention did not run "
        "(`tierstate flush` again copies the rest, resuming a half-copied step)\n"
    )
    assert pfs.steps() == [1] and pfs.partial_dir(2).is_dir()
    assert cli.main(["flush", "--config", str(tiered), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    reports = [(f["step"], f["report"]["frames_reused"]) for f in document["flushes"]]
    assert reports == [(2, 2), (3, 0)] and pfs.steps() == [1, 2, 3]


def test_ctrl_c_in_flush_with_json_gives_the_document_of_what_ended(tiered, capsys) -> None:
    copied = []

    def press_ctrl_c(_path: Path | None) -> None:
        copied.append(1)
        if len(copied) == 1:
            signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with faults.inject("migrate.frame", press_ctrl_c):
            assert cli.main(["flush", "--config", str(tiered), "--json"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    out, err = capsys.readouterr()
    assert json.loads(out) == {"flushes": [], "pruned": [], "interrupted": True}
    assert err.startswith("tierstate flush: interrupted; nothing published before it; retention did not run")


def test_ctrl_c_in_migrate_all_names_only_the_steps_it_published(tiered, tmp_path, capsys) -> None:
    """A step found already there was not published by this run: the summary does not claim it."""
    nvme, pfs = FilesystemTier("nvme", tmp_path / "nvme"), FilesystemTier("pfs", tmp_path / "pfs")
    migrate(1, nvme, pfs)
    frames = _frames(nvme, 2)
    copied = []

    def press_ctrl_c(_path: Path | None) -> None:
        copied.append(1)
        if len(copied) == frames + 1:  # step 2 published, step 3's first frame
            signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with faults.inject("migrate.frame", press_ctrl_c):
            assert cli.main(["migrate", "--all", "--from", "nvme", "--to", "pfs", "--config", str(tiered)]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == "step 1: nvme -> pfs: already there" and len(out.splitlines()) == 2
    assert err == (
        "tierstate migrate: interrupted; published before it: step 2 on pfs; the step being copied was not "
        "published (the same command again resumes it)\n"
    )
    assert pfs.steps() == [1, 2]


# --- rates over the bytes moved; one unit style ---------------------------------------------------
def test_a_resumed_copy_rates_only_the_bytes_it_copied(tiered, tmp_path) -> None:
    """``copied 2 of 6 frames (resumed: 4), 0.40 GB in 1.65 s (0.24 GB/s)`` under a 100 MB/s cap counted the
    frames found already there as moved."""
    nvme, pfs = FilesystemTier("nvme", tmp_path / "nvme"), FilesystemTier("pfs", tmp_path / "pfs")
    copied = []

    def stop(_path: Path | None) -> None:
        copied.append(1)
        if len(copied) == 2:
            raise KeyboardInterrupt

    with faults.inject("migrate.frame", stop), pytest.raises(KeyboardInterrupt):
        migrate(3, nvme, pfs)
    report = migrate(3, nvme, pfs)
    assert report.frames_reused == 2 and 0 < report.bytes_copied < nvme.manifest(3).stored_bytes
    assert report.gbps == pytest.approx(report.bytes_copied / report.seconds / 1e9)
    whole = render.size(report.bytes_copied + report.bytes_reused)
    assert render.migrate_line(report) == (
        f"step 3: nvme -> pfs: copied {report.frames_copied} of {report.frames} frames (resumed: 2 already there "
        f"and verified), {render.size(report.bytes_copied)} of {whole} in {report.seconds:.2f} s "
        f"({render.rate(report.bytes_copied, report.seconds)}), verified, published"
    )


@pytest.mark.slow  # a CLI process of its own, which loads torch
def test_sizes_are_written_one_way_in_bars_and_lines(tiered, tmp_path) -> None:
    code, shown = _on_terminal(["migrate", "2", "--from", "nvme", "--to", "pfs", "--config", str(tiered)], columns=150)
    assert code == 0, shown
    assert re.search(r"\rstep 2 .*━.* 4\.2/4\.2 MB \d+\.\d [kMG]B/s", shown), shown  # the bar, drawn over itself
    assert re.search(r"^step 2: nvme -> pfs: copied \d+ of \d+ frames, 4\.2 MB in .* \(\d+\.\d [kMG]B/s\)", shown,
                     re.M), shown  # fmt: skip
    assert [render.size(n) for n in (512, 4_194_304, 1_520_000_000)] == ["512 bytes", "4.2 MB", "1.5 GB"]
