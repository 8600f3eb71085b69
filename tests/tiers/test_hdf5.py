"""HDF5 checkpoints and exports: readable by h5py (and safetensors) alone, every byte checksummed."""

from __future__ import annotations

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tierstate import cli
from tierstate.providers import ObjectProvider, TensorDictProvider
from tierstate.tiers.format.dtypes import DTYPES
from tierstate.tiers.format.format import parse_index
from tierstate.tiers.ops.verify import verify_step
from tierstate.tiers.storage.filesystem import FilesystemTier

NATIVE = {"bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16", "float32",
          "float64", "complex64", "complex128"}  # fmt: skip


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for name, dtype in sorted(DTYPES.items()):
        raw = torch.randint(0, 256, (5 * 7 * dtype.itemsize,), dtype=torch.uint8, generator=gen)
        tensors[name] = raw.view(dtype).reshape(5, 7)
    tensors["big"] = torch.randn(3 << 18, generator=gen)  # 3 MiB: split over 1 MiB chunks
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    tensors["empty"] = torch.empty(0, 4)
    tensors["tied"] = tensors["float32"]
    return tensors


def test_hdf5_checkpoint_opens_with_h5py_alone_and_restores_bit_exactly(make_runner):
    tensors = _tensors()
    expected = {k: _bytes(v) for k, v in tensors.items()}
    runner = make_runner(pipeline__stages__persist__format="hdf5", chunk_size="1MiB", host_cache__size="4MiB")
    runner.register(t=TensorDictProvider(tensors), meta=ObjectProvider({"epoch": 3, "lr": [0.1, 0.01]}))
    path = runner.checkpoint(5).result().path
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "rank-00000.h5", "rank-00000.index"]

    with h5py.File(path / "rank-00000.h5", "r") as f:
        for name, tensor in tensors.items():
            dataset = f[f"t/{name}"]
            dtype = str(tensor.dtype).removeprefix("torch.")
            assert dataset.attrs["dtype"] == dtype and list(dataset.attrs["shape"]) == list(tensor.shape)
            assert dataset.shape == tuple(tensor.shape)
            assert bool(dataset.attrs["raw"]) == (dtype not in NATIVE)
            if dtype in NATIVE:  # a plain HDF5 dataset of the same type
                assert np.array_equal(dataset[()], tensor.numpy(), equal_nan=dtype.startswith(("float", "complex")))
            else:  # raw bytes in an unsigned dataset of the same element size
                assert dataset.dtype.itemsize == tensor.element_size() and dataset[()].tobytes() == expected[name]
        bf16 = torch.from_numpy(f["t/bfloat16"][()]).view(torch.bfloat16)
        assert torch.equal(bf16.view(torch.uint16), tensors["bfloat16"].view(torch.uint16))
        assert f["t/tied"].id == f["t/float32"].id  # tied tensors are one dataset, hard-linked
        assert f["meta/value"].attrs["serializer"] == "msgpack" and f["meta/value"].dtype == np.uint8

    for t in tensors.values():
        t.reshape(-1).view(torch.uint8).fill_(0x5A)
    runner.restore(5)
    assert all(_bytes(tensors[k]) == v for k, v in expected.items())
    assert verify_step(runner.durable_tier, 5).ok


def test_hdf5_library_bytes_are_checksummed_too(make_runner, capsys):
    runner = make_runner(pipeline__stages__persist__format="hdf5")
    runner.register(t=TensorDictProvider({"w": torch.ones(1000)}))
    path = runner.checkpoint(1).result().path
    data = path / "rank-00000.h5"
    raw = bytearray(data.read_bytes())
    raw[60] ^= 0x01  # inside the superblock / root object header, outside any dataset
    data.write_bytes(bytes(raw))
    assert cli.main(["verify", "--tier", f"nvme={path.parent}"]) == 1
    assert "rank-00000.h5 frame" in capsys.readouterr().out


def test_hdf5_needs_uncompressed_chunks(make_runner):
    with pytest.raises(ValueError, match=r"pipeline.stages.compress.codec: format hdf5 stores datasets uncompressed"):
        make_runner(pipeline__stages__persist__format="hdf5", pipeline__stages__compress__codec="zstd")


@pytest.mark.parametrize("persisted", ["frames", "hdf5"])
def test_exports_open_with_h5py_and_safetensors_alone_and_hold_the_same_tensors(make_runner, tmp_path, persisted):
    tensors = _tensors()
    runner = make_runner(pipeline__stages__persist__format=persisted, chunk_size="1MiB", host_cache__size="4MiB")
    runner.register(t=TensorDictProvider(tensors), meta=ObjectProvider({"epoch": 3}))
    runner.checkpoint(8).result()
    tiers = ["--tier", f"nvme={tmp_path / 'nvme'}"]
    assert cli.main(["export", "8", str(tmp_path / "out.h5"), "--format", "hdf5", *tiers]) == 0
    assert cli.main(["export", "8", str(tmp_path / "out.safetensors"), "--format", "safetensors", *tiers]) == 0

    with h5py.File(tmp_path / "out.h5", "r") as f:
        assert f.attrs["step"] == 8
        for name, tensor in tensors.items():
            assert f[f"t/{name}"][()].tobytes() == _bytes(tensor), name
        assert f["meta/value"][()].tobytes() == b"\x81\xa5epoch\x03"  # msgpack {"epoch": 3}

    loaded = load_file(tmp_path / "out.safetensors")
    with safe_open(tmp_path / "out.safetensors", framework="pt") as f:
        meta = f.metadata()
    raw = json.loads(meta["tierstate.raw"])
    assert json.loads(meta["tierstate.aliases"]) == {"t/tied": "t/float32"} and "t/tied" not in loaded
    assert json.loads(meta["tierstate.objects"]) == {"meta/value": "msgpack"}
    assert loaded["t/bfloat16"].dtype == torch.bfloat16 and "t/bfloat16" not in raw  # native bf16
    for name, tensor in tensors.items():
        if name == "tied":
            continue
        got = loaded[f"t/{name}"]
        assert _bytes(got) == _bytes(tensor), name
        if f"t/{name}" in raw:
            assert raw[f"t/{name}"] == {"dtype": name, "shape": list(tensor.shape)}
        else:
            assert got.dtype == tensor.dtype and got.shape == tensor.shape


def test_migrate_to_hdf5_then_restore_from_it(make_runner, tmp_path):
    tensors = _tensors()
    expected = {k: _bytes(v) for k, v in tensors.items()}
    runner = make_runner()
    runner.register(t=TensorDictProvider(tensors))
    runner.checkpoint(2).result()
    tiers = ["--tier", f"nvme={tmp_path / 'nvme'}", "--tier", f"pfs={tmp_path / 'pfs'}"]
    assert cli.main(["migrate", "2", "--from", "nvme", "--to", "pfs", "--format", "hdf5", "--move", *tiers]) == 0
    assert FilesystemTier("nvme", tmp_path / "nvme").steps() == []
    # The rewritten checkpoint's index describes the rewritten file, not the source's.
    moved = FilesystemTier("pfs", tmp_path / "pfs")
    index = parse_index((moved.step_dir(2) / "rank-00000.index").read_bytes(), "rewritten index")
    assert index.items == moved.manifest(2).items and set(index.items) == {f"t/{k}" for k in tensors}
    assert {p.file for record in index.items.values() for p in getattr(record, "pieces", [])} == {"rank-00000.h5"}
    for t in tensors.values():
        t.reshape(-1).view(torch.uint8).fill_(0)
    assert runner.restore(2).tier == "pfs"
    assert all(_bytes(tensors[k]) == v for k, v in expected.items())


# --- h5py, an optional dependency -----------------------------------------------------------------
H5PY_PROBE = """
import sys, tempfile
import torch
{hide}
from tierstate import ConfigError, Runner, TensorDictProvider
root = tempfile.mkdtemp()
tiers = {{"nvme": {{"path": root + "/nvme"}}}}
state = {{"w": torch.arange(4.0)}}
runner = Runner.from_dict({{"tiers": tiers}})
runner.register(t=TensorDictProvider(state))
runner.checkpoint(1).result()
state["w"].zero_()
runner.restore("latest")
runner.close()
print("restored", state["w"].tolist(), "h5py loaded:", sys.modules.get("h5py") is not None)
hdf5 = {{"tiers": tiers, "pipeline": {{"stages": {{
    "capture": {{"next": "serialize"}}, "serialize": {{"next": "persist"}}, "persist": {{"format": "hdf5"}}}}}}}}
try:
    Runner.from_dict(hdf5).close()
    print("hdf5 runner made, h5py loaded:", sys.modules.get("h5py") is not None)
except ConfigError as exc:
    print("refused:", exc)
"""


@pytest.mark.parametrize("installed", [True, False])
def test_only_writing_hdf5_needs_h5py(installed: bool) -> None:
    """A runner writing frames never imports h5py (0.1 s, an optional extra); a config that asks for
    HDF5 without it is refused when it loads, naming the key and the extra."""
    hide = "" if installed else "sys.modules['h5py'] = None  # as if not installed"
    done = subprocess.run([sys.executable, "-c", H5PY_PROBE.format(hide=hide)], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "restored [0.0, 1.0, 2.0, 3.0] h5py loaded: False"
    if installed:
        assert lines[1] == "hdf5 runner made, h5py loaded: False"  # not even then, until it writes
    else:
        assert lines[1] == (
            "refused: <config>: pipeline.stages.persist.format: format hdf5 is written with h5py, which is not "
            "installed: pip install 'tierstate[hdf5]'"
        )


def test_writing_hdf5_without_h5py_fails_naming_the_extra(tmp_path, monkeypatch) -> None:
    from tierstate.tiers.format.hdf5 import Hdf5Container
    from tierstate.tiers.format.hdf5_extra import Hdf5UnavailableError

    monkeypatch.setitem(sys.modules, "h5py", None)
    with pytest.raises(Hdf5UnavailableError, match=r"pip install 'tierstate\[hdf5\]'"):
        Hdf5Container(tmp_path / "x.h5", 4096, {})
    assert issubclass(Hdf5UnavailableError, ImportError) and not (tmp_path / "x.h5").exists()
