"""The ``tierstate`` CLI reads a pipeline YAML exactly as the runner does: what the runner refuses,
the CLI refuses (before touching a checkpoint), and a tier path means the same directory to both."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import torch
import yaml

import tierstate
from conftest import DEFAULT_YAML, REPO
from tierstate import cli
from tierstate.cli import options
from tierstate.cli.parser import build_parser
from tierstate.pipeline.config import load_config
from tierstate.pipeline.runner import Runner
from tierstate.providers import TensorDictProvider
from tierstate.tiers.format.format import read_manifest
from tierstate.tiers.storage.filesystem import FilesystemTier


def _config(tiers: dict[str, dict]) -> dict:
    """configs/default.yaml with these tiers, small sizes, as a mapping to edit or dump."""
    data = yaml.safe_load(DEFAULT_YAML.read_text())
    data.update(tiers=tiers, chunk_size="1MiB", host_cache={"size": "4MiB"})
    return data


def _write(path: Path, data: dict | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def _checkpoints(config: Path, steps: list[int]) -> list[FilesystemTier]:
    """Commit ``steps`` with a runner built from ``config``; the runner's tiers."""
    runner = Runner.from_yaml(config)
    try:
        runner.register(t=TensorDictProvider({"w": torch.arange(1000, dtype=torch.float32)}))
        for step in steps:
            runner.checkpoint(step).result()
    finally:
        runner.close()
    return runner.tiers


def test_retention_written_twice_is_refused_and_nothing_is_deleted(tmp_path, capsys):
    """Plain YAML keeps the last ``retention:``; the runner refuses the file, so prune must too."""
    nvme = tmp_path / "nvme"
    text = yaml.safe_dump(_config({"nvme": {"path": str(nvme)}}), sort_keys=False)
    path = _write(tmp_path / "twice.yaml", text)
    _checkpoints(path, [1, 2, 3, 4])
    twice = text.replace(
        f"    path: {nvme}\n", f"    path: {nvme}\n    retention: {{keep_last: 4}}\n    retention: {{keep_last: 1}}\n"
    )
    assert twice.count("retention:") == 2
    _write(path, twice)
    assert cli.main(["prune", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"tierstate: {path}: line " in err and "invalid YAML: duplicate key 'retention'" in err, err
    assert FilesystemTier("nvme", nvme).steps() == [1, 2, 3, 4]


@pytest.mark.parametrize(("key_path", "message"), [
    ("pipeline.stages.persist.formt", "unknown key; did you mean 'format'?"),
    ("pipeline.stagse", "unknown key; did you mean 'stages'?"),
    ("tiers.nvme.retention.keep_lst", "unknown key; did you mean 'keep_last'?"),
])  # fmt: skip
def test_an_unknown_key_anywhere_is_refused_with_its_key_path(tmp_path, capsys, key_path, message):
    data = _config({"nvme": {"path": str(tmp_path / "nvme"), "retention": {"keep_last": 2}}})
    *parents, leaf = key_path.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = "hdf5"
    path = _write(tmp_path / "typo.yaml", data)
    assert cli.main(["ls", "--config", str(path)]) == 2
    assert f"tierstate: {path}: {key_path}: {message}" in capsys.readouterr().err.splitlines()


def test_relative_tier_paths_resolve_as_the_runner_resolves_them(tmp_path, monkeypatch, capsys):
    """Against the working directory (not the YAML's), '..' taken lexically (not through a symlink)."""
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere" / "deep"
    run.mkdir()
    elsewhere.mkdir(parents=True)
    (run / "link").symlink_to(elsewhere)
    monkeypatch.chdir(run)
    config = _write(tmp_path / "etc" / "pipeline.yaml", _config({"nvme": {"path": "link/../ckpt"}}))
    runner_tiers = _checkpoints(config, [3])
    assert runner_tiers == [FilesystemTier("nvme", run / "ckpt")]
    assert [p.tier for p in options.load_tiers(str(config), None)] == runner_tiers
    assert [p.tier for p in options.load_tiers(None, ["nvme=link/../ckpt"])] == runner_tiers
    assert cli.main(["ls", "--json", "--config", str(config)]) == 0
    assert [(e["tier"], e["step"]) for e in json.loads(capsys.readouterr().out)] == [("nvme", 3)]


@pytest.mark.parametrize(("option", "message"), [
    ("nvme", "--tier 'nvme': expected NAME=PATH"),
    ("NVMe=x", "--tier 'NVMe=x': tiers.NVMe: invalid name: string should match pattern '^[a-z][a-z0-9_-]*$'"),
    ("nvme=  ", "--tier 'nvme=  ': tiers.nvme.path: must not be empty"),
])  # fmt: skip
def test_a_bad_tier_option_is_named(tmp_path, capsys, option, message):
    assert cli.main(["ls", "--tier", option]) == 2
    assert f"tierstate: {message}" in capsys.readouterr().err


# --- the command line as people expect it ------------------------------------------------------
def _tierstate(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m tierstate ARGS`` in its own process, stdout and stderr piped (not a terminal)."""
    return subprocess.run([sys.executable, "-m", "tierstate", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip


def _on_terminal(
    args: list[str], answer: str | None = None, columns: int = 72, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """``python -m tierstate ARGS`` on a pseudo-terminal ``columns`` wide (stdin, stdout and stderr), as a
    person runs it; ``answer`` is typed once a question ending in ``[y/N]`` shows. The exit code, and
    what the terminal showed (line ends as ``\\n``, colours removed)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: size the terminal, then become the CLI
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
        inherited = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}  # e.g. set by pytest
        os.execve(sys.executable, [sys.executable, "-m", "tierstate", *args], {**inherited, **(env or {})})
    shown, asked = b"", False
    while True:
        ready, _, _ = select.select([fd], [], [], 300)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            raise TimeoutError(f"tierstate {' '.join(args)} showed {shown!r} and stopped")
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the child is gone and the terminal closed
            data = b""
        if not data:
            break
        shown += data
        if answer is not None and not asked and shown.rstrip().endswith(b"[y/N]"):
            os.write(fd, answer.encode() + b"\n")
            asked = True
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.decode()).replace("\r\n", "\n")
    return os.waitstatus_to_exitcode(status), text


def test_help_and_version_answer_without_importing_torch() -> None:
    probe = (
        "import sys\n"
        "from tierstate.cli import main\n"
        "for argv in (['--help'], ['--version'], ['migrate', '--help'], ['prune', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as exit:\n"
        "        assert exit.code == 0, (argv, exit.code)\n"
        "print('torch loaded:', 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    assert f"tierstate {tierstate.__version__}\n" in done.stdout
    assert "--bandwidth SIZE" in done.stdout and "-y, --yes" in done.stdout
    assert done.stdout.endswith("torch loaded: False\n")


def test_init_writes_an_editable_copy_of_a_packaged_config(tmp_path, capsys) -> None:
    assert cli.main(["init", str(tmp_path / "conf")]) == 0
    written = tmp_path / "conf" / "default.yaml"
    assert written.read_text() == (REPO / "configs" / "default.yaml").read_text()  # comments and all
    assert f"wrote {written}" in capsys.readouterr().out
    assert cli.main(["init", str(tmp_path / "conf")]) == 2  # never overwrites unasked
    assert f"tierstate: {written} exists; give --force to replace it" in capsys.readouterr().err
    written.write_text("edited")
    assert cli.main(["init", str(tmp_path / "conf"), "--force"]) == 0 and written.read_text() != "edited"
    assert cli.main(["init", str(tmp_path), "--from", "tiered"]) == 0
    assert load_config(str(tmp_path / "tiered.yaml")).tiers["pfs"].flush is not None
    assert cli.main(["init", str(tmp_path), "--from", "fast"]) == 2
    refused = "--from 'fast': no such packaged config (packaged: cluster, compressed, default, tiered)"
    assert refused in capsys.readouterr().err


def test_a_tier_directory_that_is_not_there_is_an_error_not_an_empty_list(tmp_path, monkeypatch, capsys) -> None:
    nvme = _checkpoints(_write(tmp_path / "c.yaml", _config({"nvme": {"path": str(tmp_path / "nvme")}})), [1])[0]
    missing = tmp_path / "nvmee"
    for args in (["ls"], ["verify"], ["gc"], ["inspect", "1"], ["export", "1", str(tmp_path / "x.h5"), "--format",
                                                               "hdf5"]):
        assert cli.main([*args, "--tier", f"nvme={missing}"]) == 2, args
        assert f"tierstate: no such tier directory: nvme ({missing});" in capsys.readouterr().err, args
    assert cli.main(["migrate", "1", "--from", "nvme", "--to", "pfs", "--tier", f"nvme={missing}",
                     "--tier", f"pfs={tmp_path / 'pfs'}"]) == 2  # fmt: skip
    assert f"no such tier directory: nvme ({missing})" in capsys.readouterr().err
    # A config's relative paths read from another directory: the error says where they were looked for.
    monkeypatch.chdir(tmp_path / "nvme")
    assert cli.main(["ls", "--config", "default"]) == 2
    assert f"relative paths are taken from the working directory ({tmp_path / 'nvme'})" in capsys.readouterr().err
    # One tier there and one not (a flush tier before its first flush): listed, and the other noted.
    assert cli.main(["ls", "--tier", f"nvme={nvme.root}", "--tier", f"pfs={tmp_path / 'pfs'}"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[1].startswith("nvme  1 ") and f"tier pfs has no directory {tmp_path / 'pfs'}" in err


def test_output_to_a_file_or_pipe_is_plain_whole_lines(make_runner, tmp_path) -> None:
    keys = [f"encoder_transformer_block_{i}.self_attention.query_key_value.{part}" for i in range(2)
            for part in ("weight", "bias")]  # fmt: skip
    runner = make_runner(chunk_size="1MiB", host_cache__size="4MiB")
    runner.register(model=TensorDictProvider({key: torch.zeros(8) for key in keys}))
    runner.checkpoint(7).result()
    manifest = read_manifest(tmp_path / "nvme" / "step-7")
    tiers = ["--tier", f"nvme={tmp_path / 'nvme'}"]
    shown = _tierstate("inspect", "7", *tiers)  # piped, as `tierstate inspect 7 > file` or `| grep`
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == f"step 7: 4 items, {manifest.raw_bytes:,} bytes"
    assert lines[1].split() == ["key", "kind", "type", "shape", "bytes"]
    rows = sorted(line.split() for line in lines[2:])
    assert rows == sorted([f"model/{key}", "tensor", "float32", "8", "32"] for key in keys)
    listed = _tierstate("ls", *tiers).stdout.splitlines()
    assert listed[0].split() == ["tier", "step", "state", "items", "stored", "bytes", "created"]
    assert listed[1].split() == ["nvme", "7", "committed", "4", f"{manifest.stored_bytes:,}", manifest.created]
    assert "…" not in shown.stdout + "\n".join(listed)


def test_on_a_terminal_tables_fold_long_cells_and_cut_nothing(make_runner, tmp_path) -> None:
    key = "encoder_transformer_block_0.self_attention.query_key_value.weight_with_a_long_name"
    runner = make_runner(chunk_size="1MiB", host_cache__size="4MiB")
    runner.register(model=TensorDictProvider({key: torch.zeros(8)}))
    runner.checkpoint(7).result()
    code, shown = _on_terminal(["inspect", "7", "--tier", f"nvme={tmp_path / 'nvme'}"], columns=60)
    assert code == 0 and "…" not in shown
    assert all(len(line) <= 60 for line in shown.splitlines()), shown
    cells = "".join(re.findall(r"^│\s*(\S+?)\s*│", shown, flags=re.MULTILINE))  # the key column, line by line
    assert f"model/{key}" in cells


@pytest.mark.parametrize(("columns", "env"), [(40, None), (150, None), (150, {"COLUMNS": "40"})])
def test_on_a_narrow_terminal_no_value_is_folded_mid_word(make_runner, tmp_path, columns, env) -> None:
    """``commit/ted``: rich narrowed every column evenly and broke short words. A word that fits the
    terminal is shown whole, in a table while one fits, else as ``column: value`` lines. ``COLUMNS``
    set in the environment counts as the terminal's width."""
    runner = make_runner(chunk_size="1MiB", host_cache__size="4MiB")
    runner.register(model=TensorDictProvider({"weight": torch.zeros(8)}))
    runner.checkpoint(7).result()
    manifest = read_manifest(tmp_path / "nvme" / "step-7")
    code, shown = _on_terminal(["ls", "--tier", f"nvme={tmp_path / 'nvme'}"], columns=columns, env=env)
    columns = int((env or {}).get("COLUMNS", columns))
    assert code == 0 and "…" not in shown
    assert all(len(line) <= columns for line in shown.splitlines()), shown
    words = set(re.findall(r"[^\s│┃┡┩━─┏┓┗┛┌┐└┘╇╈┳┻╋]+", shown))
    assert {"nvme", "7", "committed", f"{manifest.stored_bytes:,}", manifest.created} <= words, shown
    assert ("│" in shown) == (columns == 150)  # a table where one fits


@pytest.mark.parametrize(
    ("typed", "meant"), [("lss", "ls"), ("verfy", "verify"), ("migrat", "migrate"), ("frob", None)]
)
def test_a_mistyped_command_is_answered_with_the_one_meant(typed, meant) -> None:
    done = _tierstate(typed, "--tier", "nvme=x")
    assert done.returncode == 2 and done.stdout == ""
    last = done.stderr.splitlines()[-1]
    commands = ", ".join(build_parser().chooser.choices)
    assert commands.startswith("ls, inspect, stats, trace, migrate, verify, prune")
    guess = f"; did you mean {meant!r}?" if meant else ""
    assert last == f"tierstate: error: no command {typed!r}{guess} (commands: {commands})"


def test_every_message_names_the_same_packaged_configs(tmp_path, capsys) -> None:
    from tierstate.pipeline.packaged import packaged_configs

    packaged = ", ".join(packaged_configs())
    assert packaged == "cluster, compressed, default, tiered"
    assert f"or a packaged config by name: {packaged})" in " ".join(_tierstate("--help").stdout.split())
    assert f"a packaged config: {packaged}" in " ".join(_tierstate("init", "--help").stdout.split())
    assert cli.main(["ls"]) == 2
    assert f"(or a packaged config: {packaged})" in capsys.readouterr().err
    assert cli.main(["ls", "--config", "nope"]) == 2
    assert f"(packaged configs, by name: {packaged};" in capsys.readouterr().err
    assert cli.main(["init", "--from", "nope", str(tmp_path)]) == 2
    assert f"(packaged: {packaged})" in capsys.readouterr().err


def test_output_into_a_pipe_closed_early_ends_quietly(make_runner, tmp_path) -> None:
    """``tierstate inspect 7 | head -1``: the reader goes away while the CLI still writes (the listing is
    larger than a pipe holds); it stops with exit code 141, as SIGPIPE would, and no BrokenPipeError."""
    runner = make_runner(chunk_size="1MiB", host_cache__size="4MiB")
    runner.register(model=TensorDictProvider({f"layer_{i}.weight": torch.zeros(2) for i in range(3000)}))
    runner.checkpoint(7).result()
    tiers = ["--tier", f"nvme={tmp_path / 'nvme'}"]
    command = [sys.executable, "-m", "tierstate", "inspect", "7", *tiers]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout is not None and child.stderr is not None
    assert child.stdout.readline().startswith(b"step 7: 3000 items")
    child.stdout.close()  # as head does after its line
    err = child.stderr.read().decode()
    assert child.wait(timeout=300) == 141 and err == ""
    # The reader gone before the first write: the same.
    read, write = os.pipe()
    os.close(read)
    done = subprocess.run([sys.executable, "-m", "tierstate", "ls", *tiers], stdout=write, capture_output=False,
                          stderr=subprocess.PIPE, text=True, timeout=300, check=False)  # fmt: skip
    os.close(write)
    assert done.returncode == 141 and done.stderr == ""


@pytest.mark.parametrize("columns", [40, 150])
def test_on_a_terminal_cells_are_shown_as_written_not_as_markup(make_runner, tmp_path, columns) -> None:
    """rich reads ``[...]`` in a string as markup: a key ``w[bold]`` lost its bracket and ``[/x]`` crashed it."""
    keys = ["w[bold]", "v[/x]"]
    runner = make_runner(chunk_size="1MiB", host_cache__size="4MiB")
    runner.register(m=TensorDictProvider({key: torch.zeros(2) for key in keys}))
    runner.checkpoint(7).result()
    code, shown = _on_terminal(["inspect", "7", "--tier", f"nvme={tmp_path / 'nvme'}"], columns=columns)
    assert code == 0, shown
    assert all(f"m/{key}" in shown for key in keys), shown
