"""Clean failures: whatever is wrong with a tier or a checkpoint, the answer is a named error, never a traceback.

- ``verify`` on a read-only or full tier still reports its result (and exit code); the stamp it
  could not write or remove is a warning.
- A directory where a data file or an index should be, an item HDF5 cannot name, a per-rank item
  rank 0 has no value of: ``verify``, ``load``, ``export`` and ``migrate`` name the file or item
  (``verify`` and ``export`` per checkpoint, exit code 1), and so does restore, which falls back.
- Any tierstate error that reaches the command line is one line on stderr, exit code 1.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from faultkit import bind, make_runner, set_read_only, state_matches, tmpfs, trainer, write_steps
from tierstate import cli
from tierstate.errors import TierstateError
from tierstate.pipeline.restore import NoCheckpointError
from tierstate.providers import TensorDictProvider
from tierstate.tiers.format.format import MissingItemError, manifest_bytes, read_manifest
from tierstate.tiers.format.manifest import MANIFEST_NAME
from tierstate.tiers.ops.verify import STAMP_NAME
from tierstate.tiers.reading.stored import load

pytestmark = pytest.mark.faults

DATA, INDEX = "rank-00000.data", "rank-00000.index"


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _nvme(root: Path) -> list[str]:
    return ["--tier", f"nvme={root / 'nvme'}"]


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


# --- verify on a tier it cannot write ---------------------------------------------------------------


def test_verify_and_prune_on_a_read_only_tier_report_their_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_steps(tmp_path, [1, 2])
    assert _cli(capsys, "verify", "2", *_nvme(tmp_path))[0] == 0  # stamped while writable
    frame = read_manifest(tmp_path / "nvme" / "step-2").files[DATA].frames[1]
    _flip(tmp_path / "nvme" / "step-2" / DATA, frame.offset + frame.length // 2)  # inside it, whatever its size
    with bind(tmp_path / "nvme"):
        set_read_only(tmp_path / "nvme", True)
        try:
            good = _cli(capsys, "verify", "1", *_nvme(tmp_path))
            bad = _cli(capsys, "verify", "2", *_nvme(tmp_path))
            as_json = _cli(capsys, "verify", "1", "--json", *_nvme(tmp_path))
            pruned = _cli(capsys, "prune", "--keep-last", "1", *_nvme(tmp_path))
        finally:
            set_read_only(tmp_path / "nvme", False)
    code, out, err = good
    assert code == 0 and "nvme step 1: ok (" in out and not err
    assert f"warning: {tmp_path / 'nvme' / 'step-1' / STAMP_NAME}: not recorded: Read-only file system" in out
    code, out, _ = bad
    assert code == 1 and "nvme step 2: FAILED" in out and f"{DATA} frame 1: bytes" in out
    assert f"{STAMP_NAME}: not recorded: Read-only file system" in out  # the damaged stamp could not be written
    [document] = json.loads(as_json[1])
    assert as_json[0] == 0 and document["ok"] and "Read-only file system" in document["warnings"][0]
    assert pruned[0] == 0 and "nvme step 1: kept (cannot delete: Read-only file system)" in pruned[1]


def test_verify_on_a_full_tier_reports_its_result_and_warns_about_the_stamp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with tmpfs(tmp_path / "nvme", "8m"):
        write_steps(tmp_path, [1])
        filler = tmp_path / "nvme" / "filler"
        with open(filler, "wb") as out:
            try:
                while True:
                    out.write(bytes(1 << 16))
                    out.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        code, out, err = _cli(capsys, "verify", *_nvme(tmp_path))
        filler.unlink()
    assert code == 0 and "nvme step 1: ok (" in out and not err
    assert f"{STAMP_NAME}: not recorded: No space left on device" in out


# --- damaged and unusual checkpoints ------------------------------------------------------------------


def _tiny_steps(root: Path, steps: list[int]) -> dict[str, torch.Tensor]:
    """Commit ``steps`` of a 32-byte state (data files smaller than a directory's size); the live state."""
    state = {"w": torch.zeros(8)}
    runner = make_runner(root)
    runner.register(t=TensorDictProvider(state))
    for step in steps:
        state["w"].fill_(step)
        runner.checkpoint(step).result()
    runner.close()
    return state


@pytest.mark.parametrize("name", [DATA, INDEX])
def test_a_directory_in_place_of_a_file_is_named_by_verify_load_export_and_restore(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    _tiny_steps(tmp_path, [1, 2])
    step2 = tmp_path / "nvme" / "step-2"
    os.unlink(step2 / name)
    os.mkdir(step2 / name)
    code, out, _ = _cli(capsys, "verify", "2", *_nvme(tmp_path))
    assert code == 1 and "nvme step 2: FAILED\n" in out
    assert f"\n  {name}: is a directory, not a regular file; refused" in out
    code, out, _ = _cli(capsys, "migrate", "2", "--from", "nvme", "--to", "pfs", *_nvme(tmp_path),
                        "--tier", f"pfs={tmp_path / 'pfs'}")  # fmt: skip
    assert code == 1 and "step 2: nvme -> pfs: FAILED: " in out and f"{name}: is a directory" in out
    if name == INDEX:  # only verify and migrate read the index
        return
    refused = f"{step2 / DATA}: is a directory, not a regular file; refused"
    with pytest.raises(TierstateError, match=re.escape(refused)):
        load(step2)
    code, out, _ = _cli(capsys, "export", "2", str(tmp_path / "out.h5"), "--format", "hdf5", *_nvme(tmp_path))
    assert code == 1 and "export failed: nvme: " in out and refused in out
    runner = make_runner(tmp_path)
    state = {"w": torch.zeros(8)}
    runner.register(t=TensorDictProvider(state))
    result = runner.restore("latest", fallback=True)
    runner.close()
    assert result.step == 1 and torch.equal(state["w"], torch.ones(8))
    assert refused in result.problems[0]


def test_an_item_hdf5_cannot_name_fails_its_export_and_conversion_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runner = make_runner(tmp_path)
    runner.register(t=TensorDictProvider({"./b": torch.ones(3)}))
    runner.checkpoint(1).result()
    runner.close()
    code, out, _ = _cli(capsys, "export", "1", str(tmp_path / "out.h5"), "--format", "hdf5", *_nvme(tmp_path))
    assert code == 1 and "export failed: nvme: item 't/./b': not a valid HDF5 path" in out
    assert not (tmp_path / "out.h5").exists()
    code, out, _ = _cli(capsys, "migrate", "1", "--from", "nvme", "--to", "pfs", "--format", "hdf5",
                        *_nvme(tmp_path), "--tier", f"pfs={tmp_path / 'pfs'}")  # fmt: skip
    assert code == 1 and "step 1: nvme -> pfs: FAILED: item 't/./b': not a valid HDF5 path" in out
    assert (
        cli.main(["export", "1", str(tmp_path / "out.safetensors"), "--format", "safetensors", *_nvme(tmp_path)]) == 0
    )


def _per_rank_without_rank_0(directory: Path) -> None:
    """Make the checkpoint a two-rank one in which only rank 1 saved ``meta/value`` (re-signed)."""
    body: dict[str, Any] = json.loads((directory / MANIFEST_NAME).read_bytes())["manifest"]
    body.update(version=2, world_size=2)
    body["items"]["meta/value"] = {"kind": "per_rank", "ranks": {"1": body["items"]["meta/value"]}}
    (directory / MANIFEST_NAME).write_bytes(manifest_bytes(body))


def test_a_per_rank_item_without_rank_0_is_named_by_load_export_and_restore(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_steps(tmp_path, [1, 2])
    step2 = tmp_path / "nvme" / "step-2"
    _per_rank_without_rank_0(step2)
    message = r"item 'meta/value' was saved per rank by rank\(s\) \[1\]; rank 0 has no value of it"
    with pytest.raises(MissingItemError, match=message):
        load(step2)
    code, out, _ = _cli(capsys, "export", "2", str(tmp_path / "out.h5"), "--format", "hdf5", *_nvme(tmp_path))
    assert code == 1 and "export failed: nvme: item 'meta/value' was saved per rank by rank(s) [1]" in out
    with trainer(tmp_path) as (runner, state):
        with pytest.raises(NoCheckpointError, match=message):
            runner.restore(2)
        assert runner.restore("latest", fallback=True).step == 1 and state_matches(state, 1)
