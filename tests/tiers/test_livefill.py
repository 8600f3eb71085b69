"""Restoring straight into live tensors (tiers/reading/livefill.py): verified first, then read once into them.

Real checkpoints written by a runner (1 MiB chunks, so a 3 MiB tensor spans frames and small ones
share one), real tensors as destinations, real bytes flipped in the data file. A damaged copy fails
in the first pass with no live tensor touched; a frame changed between the passes fails the second.
Fresh destinations (a model ``materialize`` just built: providers/fresh.py) are filled in one pass at read
time, verified as they land, and a damaged copy sends the restore on to the next.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierstate import materialize
from tierstate.pipeline.runner import Runner
from tierstate.providers import ModuleProvider, OptimizerProvider, TensorDictProvider
from tierstate.providers.fresh import is_fresh
from tierstate.tiers.reading.stored import CorruptCheckpointError, StoredCheckpoint

MiB = 1 << 20


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "big": torch.randn(3 * MiB // 4),  # three 1 MiB chunks and a tail: pieces in several frames
        "small": torch.randn(100),
        "grid": torch.randn(64, 48),
        "half": torch.randn(1000).to(torch.bfloat16),
    }


def _saved(make_runner, weights: dict[str, torch.Tensor]) -> Path:
    runner = make_runner(chunk_size="1MiB")
    runner.register(model=TensorDictProvider(weights))
    return runner.checkpoint(1).result().path


def _scrambled(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Live tensors of the same dtypes and shapes, holding other values."""
    return {f"model/{key}": torch.full_like(value, 7) for key, value in weights.items()}


def _data_file(directory: Path) -> Path:
    return next(directory.glob("*.data"))


def _flip_in_the_largest_frame(directory: Path, where: float) -> tuple[StoredCheckpoint, str, int]:
    """Flip the byte at ``where`` (0..1) of the data file's largest frame (a whole 1 MiB frame of "big"): the
    checkpoint, the data file's name and that frame's index."""
    checkpoint = StoredCheckpoint(directory, 1)
    data = _data_file(directory)
    frames = checkpoint.manifest.files[data.name].frames
    index = max(range(len(frames)), key=lambda i: frames[i].length)
    frame = frames[index]
    _flip(data, frame.offset + min(int(frame.length * where), frame.length - 1))
    return checkpoint, data.name, index


def _flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("stage", [False, True], ids=["direct", "staged"])
def test_fill_live_fills_the_live_tensors_themselves_bit_exact(make_runner, stage: bool) -> None:
    weights = _weights()
    directory = _saved(make_runner, weights)
    live = _scrambled(weights)
    before = {key: t.data_ptr() for key, t in live.items()}
    read = StoredCheckpoint(directory, 1).view().fill_live(live, stage=stage)
    assert read.fill is not None
    assert all(read.values[key] is live[key] for key in live)  # the live tensors, not copies of them
    assert all(bool((t == 7).all()) for t in live.values())  # verified, nothing read in yet
    read.fill()
    for key, value in weights.items():
        assert torch.equal(live[f"model/{key}"], value), key
    assert {key: t.data_ptr() for key, t in live.items()} == before


def test_a_piece_larger_than_the_staging_block_is_staged_block_by_block(make_runner) -> None:
    from tierstate.tiers.reading.livefill import STAGING

    weights = {"huge": torch.randn(9 * STAGING // 4)}  # 9 staging blocks of float32, in 8 MiB frames: 2 per piece
    runner = make_runner(chunk_size="8MiB", host_cache__size="32MiB")
    runner.register(model=TensorDictProvider(weights))
    directory = runner.checkpoint(1).result().path
    live = _scrambled(weights)
    read = StoredCheckpoint(directory, 1).view().fill_live(live, stage=True)
    assert read.fill is not None
    read.fill()
    assert torch.equal(live["model/huge"], weights["huge"])


def test_a_destination_that_does_not_fit_is_read_into_a_buffer_of_its_own(make_runner) -> None:
    weights = _weights()
    directory = _saved(make_runner, weights)
    live = _scrambled(weights)
    live["model/grid"] = torch.full((48, 64), 7.0).t()  # the stored shape, but not contiguous
    live["model/small"] = torch.full((100,), 7, dtype=torch.float64)  # another dtype
    read = StoredCheckpoint(directory, 1).view().fill_live(live)
    assert read.fill is not None
    read.fill()
    for key in ("grid", "small"):
        value = read.values[f"model/{key}"]
        assert value is not live[f"model/{key}"] and value.is_contiguous()
        assert torch.equal(value, weights[key])
        assert bool((live[f"model/{key}"] == 7).all())  # left for its provider to copy into
    assert torch.equal(live["model/big"], weights["big"])


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0], ids=["first-byte", "middle", "last-byte"])
def test_a_flipped_byte_anywhere_in_a_frame_fails_the_first_pass_with_nothing_written(
    make_runner,
    where: float,
) -> None:
    weights = _weights()
    checkpoint, data, index = _flip_in_the_largest_frame(_saved(make_runner, weights), where)
    live = _scrambled(weights)
    with pytest.raises(CorruptCheckpointError, match=rf"{data} frame {index}: checksum mismatch"):
        checkpoint.view().fill_live(live)
    assert all(bool((t == 7).all()) for t in live.values())


def test_a_frame_changed_between_the_passes_fails_the_second(make_runner) -> None:
    weights = _weights()
    directory = _saved(make_runner, weights)
    checkpoint = StoredCheckpoint(directory, 1)
    read = checkpoint.view().fill_live(_scrambled(weights))
    data = _data_file(directory)
    frame = checkpoint.manifest.files[data.name].frames[-1]
    _flip(data, frame.offset + frame.length // 2)
    assert read.fill is not None
    with pytest.raises(CorruptCheckpointError, match=r"second read .* changed in place after it was verified"):
        read.fill()


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 768), torch.nn.ReLU(), torch.nn.Linear(768, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 1024)).sum().backward()
    optimizer.step()
    return model, optimizer


def _tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    moments = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return list(model.state_dict().values()) + moments


def test_runner_restore_from_the_memory_tier_reads_into_the_live_model_and_optimizer(memory_dir: Path) -> None:
    model, optimizer = _trained()
    runner = Runner.from_dict({
        "chunk_size": "1MiB",
        "host_cache": {"size": "16MiB"},
        "tiers": {"memory": {"kind": "memory", "path": str(memory_dir), "size": "64MiB",
                             "retention": {"keep_last": 1}}},
    })  # fmt: skip
    try:
        runner.register(model=ModuleProvider(model), optim=OptimizerProvider(optimizer))
        runner.checkpoint(1).result()
        expected = [t.clone() for t in _tensors(model, optimizer)]
        identities = [t.data_ptr() for t in _tensors(model, optimizer)]
        with torch.no_grad():
            for t in _tensors(model, optimizer):
                t.fill_(3)
        data = _data_file(memory_dir / "step-1")
        frame = StoredCheckpoint(memory_dir / "step-1").manifest.files[data.name].frames[-1]
        _flip(data, frame.offset + frame.length - 1)  # the last frame: every other one is fine
        with pytest.raises(Exception, match="checksum mismatch"):
            runner.restore(1)
        assert all(bool((t == 3).all()) for t in _tensors(model, optimizer))  # nothing half applied
        _flip(data, frame.offset + frame.length - 1)  # repaired
        result = runner.restore(1)
        assert result.tier == "memory"
        assert [t.data_ptr() for t in _tensors(model, optimizer)] == identities  # read in, not handed over
        for got, want in zip(_tensors(model, optimizer), expected, strict=True):
            assert torch.equal(got, want)
    finally:
        runner.close()


def test_fresh_destinations_are_filled_in_one_pass_when_read(make_runner) -> None:
    weights = _weights()
    directory = _saved(make_runner, weights)
    live = _scrambled(weights)
    read = StoredCheckpoint(directory, 1).view().fill_live(live, fresh=list(live))
    assert read.fill is None  # nothing left for a second pass
    for key, value in weights.items():
        assert torch.equal(live[f"model/{key}"], value), key
    # One fresh destination among live ones: verified first, as for all live state.
    live = _scrambled(weights)
    read = StoredCheckpoint(directory, 1).view().fill_live(live, fresh=["model/big"])
    assert read.fill is not None and bool((live["model/big"] == 7).all())


def test_a_flipped_byte_fails_the_one_pass_read_after_the_other_frames_landed(make_runner) -> None:
    weights = _weights()
    checkpoint, data, index = _flip_in_the_largest_frame(_saved(make_runner, weights), 0.5)
    live = _scrambled(weights)
    with pytest.raises(CorruptCheckpointError, match=rf"{data} frame {index}: checksum mismatch \(expected"):
        checkpoint.view().fill_live(live, fresh=list(live))
    # No verify-before-write pass: the frames that are fine were copied in (what one pass means; fresh
    # tensors held nothing to keep), and a read of the next copy overwrites every byte.
    assert torch.equal(live["model/small"], weights["small"]) and torch.equal(live["model/grid"], weights["grid"])


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))


def test_fresh_means_materialized_storage_untouched_since() -> None:
    with torch.device("meta"):
        model = _mlp()
    materialize(model)
    weight, bias = model[0].weight, model[2].bias
    assert is_fresh(weight) and is_fresh(weight.detach()) and is_fresh(model.state_dict()["2.bias"])
    with torch.no_grad():
        bias.add_(1)  # any in-place op (an optimizer step, copy_, load_state_dict) bumps the version counter
    assert not is_fresh(bias) and is_fresh(weight)
    assert not is_fresh(torch.zeros(4)) and not is_fresh(_mlp()[0].weight)


def test_a_materialized_model_restores_in_one_pass_and_a_damaged_copy_sends_it_on(
    tmp_path: Path, memory_dir: Path
) -> None:
    torch.manual_seed(2)
    saved = _mlp()
    config = {
        "chunk_size": "1MiB", "host_cache": {"size": "16MiB"},
        "tiers": {"memory": {"kind": "memory", "path": str(memory_dir), "size": "32MiB",
                             "retention": {"keep_last": 1}},
                  "nvme": {"path": str(tmp_path / "nvme"), "flush": {"every": 1}}},
    }  # fmt: skip
    with Runner.from_dict(config) as runner:
        runner.register(model=ModuleProvider(saved))
        runner.checkpoint(1).result()
        runner.wait()
    data = _data_file(memory_dir / "step-1")
    frame = StoredCheckpoint(memory_dir / "step-1").manifest.files[data.name].frames[0]
    _flip(data, frame.offset + frame.length // 2)  # the memory copy is damaged, NVMe's is not
    with torch.device("meta"):
        model = _mlp()
    materialize(model)
    with Runner.from_dict(config) as runner:
        runner.register(model=ModuleProvider(model))
        result = runner.restore(1)
    assert result.tier == "nvme"
    for key, value in saved.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert not any(is_fresh(t) for t in model.state_dict().values())  # restored state: the next restore verifies first
