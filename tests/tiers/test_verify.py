"""``tierstate verify`` finds a flipped byte, names file and frame; restore then uses the other tier."""

from __future__ import annotations

import json

import torch

from tierstate import cli
from tierstate.providers import TensorDictProvider
from tierstate.tiers.ops.migrate import migrate
from tierstate.tiers.storage.filesystem import FilesystemTier


def test_verify_finds_a_flipped_byte_and_restore_falls_back_to_the_good_copy(make_runner, tmp_path, capsys):
    tensors = {"w": torch.randn(3 << 18), "b": torch.randn(300).to(torch.bfloat16)}
    expected = {k: v.clone() for k, v in tensors.items()}
    runner = make_runner(chunk_size="1MiB", host_cache__size="4MiB")
    runner.register(t=TensorDictProvider(tensors))
    runner.checkpoint(2).result()
    nvme, pfs = FilesystemTier("nvme", tmp_path / "nvme"), FilesystemTier("pfs", tmp_path / "pfs")
    migrate(2, nvme, pfs)
    tiers = ["--tier", f"nvme={nvme.root}", "--tier", f"pfs={pfs.root}"]
    assert cli.main(["verify", *tiers]) == 0
    assert capsys.readouterr().out.count(": ok (") == 2

    frame = nvme.manifest(2).files["rank-00000.data"].frames[1]
    data = nvme.step_dir(2) / "rank-00000.data"
    raw = bytearray(data.read_bytes())
    raw[frame.offset + frame.length // 2] ^= 0x10  # inside the frame, whatever its size
    data.write_bytes(bytes(raw))

    assert cli.main(["verify", *tiers]) == 1
    out = capsys.readouterr().out
    span = f"bytes {frame.offset}..{frame.offset + frame.length}"
    assert (
        f"nvme step 2: FAILED\n  rank-00000.data frame 1: {span}: checksum mismatch (expected {frame.checksum}" in out
    )
    assert "pfs step 2: ok" in out
    assert cli.main(["verify", "2", "--only", "nvme", "--json", *tiers]) == 1
    [report] = json.loads(capsys.readouterr().out)
    assert not report["ok"] and report["problems"][0].startswith("rank-00000.data frame 1: ")
    assert cli.main(["ls", "--json", *tiers]) == 0
    states = {e["tier"]: e["state"] for e in json.loads(capsys.readouterr().out)}
    assert states == {"nvme": "damaged", "pfs": "verified"}  # until a pass finds it clean again

    for t in tensors.values():
        t.zero_()
    result = runner.restore(2)
    assert result.tier == "pfs" and "frame 1: checksum mismatch" in result.problems[0]
    assert all(torch.equal(tensors[k], v) for k, v in expected.items())
