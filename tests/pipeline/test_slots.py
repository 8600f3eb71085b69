"""A memory tier that capture writes into: each rank's data files preallocated, mapped and reused.

Real runners on a real tmpfs (/dev/shm where usable; the size limits and kills: tests/faults/test_slot_faults.py):
capture copies into the slot, the slot is committed where it lies, retention hands its file back
to the pool, and the next checkpoint overwrites the oldest file, never the newest committed one.
"""

from __future__ import annotations

import errno
import time
from pathlib import Path

import pytest
import torch

from tierstate import cli
from tierstate.pipeline.config import ConfigError, parse_config
from tierstate.pipeline.plan import plan_checkpoint
from tierstate.pipeline.runner import Runner
from tierstate.pipeline.slotjob import SlotLayout, SlotWindows
from tierstate.pipeline.stages.capture import SlabCopier
from tierstate.providers import TensorDictProvider, TensorItem
from tierstate.tiers.format.container import Layout, TensorLayout
from tierstate.tiers.format.rankwriter import RankWriter, data_file_path
from tierstate.tiers.format.slotfile import SlotFile
from tierstate.tiers.reading.stored import StoredCheckpoint
from tierstate.tiers.storage import faults
from tierstate.tiers.storage.filesystem import FilesystemTier
from tierstate.tiers.storage.slotdirs import pool_dir
from tierstate.tiers.storage.slots import SlotPool

MiB = 1 << 20


def memory_runner(memory: Path, size: str = "64MiB", keep: int = 1, **tier: object) -> Runner:
    return Runner.from_dict({
        "chunk_size": "1MiB",
        "host_cache": {"size": "8MiB"},
        "tiers": {"memory": {"kind": "memory", "path": str(memory), "size": size, "retention": {"keep_last": keep},
                             **tier}},
    })  # fmt: skip


def _pruned_to(tier: FilesystemTier, steps: list[int]) -> None:
    """Wait until retention (in the background, after each commit) left exactly ``steps``, done deleting."""
    deadline = time.monotonic() + 30
    while tier.steps() != steps or any(tier.root.glob("*.deleting")):
        assert time.monotonic() < deadline, f"retention left {tier.steps()}, not {steps}"
        time.sleep(0.01)


def _files(root: Path) -> dict[int, str]:
    """Every data file of the tier, steps and pool alike, by inode: what holds its memory."""
    found = {}
    for path in [*root.glob("step-*/rank-*.data"), *root.glob(".slots/rank-*/free-*")]:
        found[path.stat().st_ino] = str(path.relative_to(root))
    return found


def test_retention_hands_files_back_and_the_tier_stays_flat(memory_dir: Path, capsys) -> None:
    """Twelve checkpoints: from the second on the same two files take turns, the tier's bytes do not move,
    and the file each checkpoint writes is never the newest committed one's."""
    runner = memory_runner(memory_dir)
    state = {"w": torch.randn(3 * MiB // 4), "b": torch.randn(100)}
    runner.register(weights=TensorDictProvider(state))
    memory = FilesystemTier("memory", memory_dir)
    inodes, used, writes = [], [], []
    for step in range(1, 13):
        state["w"].add_(1)
        newest = {p.stat().st_ino for p in memory_dir.glob("step-*/rank-*.data")}
        result = runner.checkpoint(step).result()
        written = (result.path / "rank-00000.data").stat().st_ino
        assert written not in newest or step == 1, "the newest committed checkpoint's file was overwritten"
        _pruned_to(memory, [step])
        writes.append(written)
        inodes.append(set(_files(memory_dir)))
        used.append(memory.bytes_used())
    assert len(set(writes)) == 2 and all(a != b for a, b in zip(writes, writes[1:], strict=False))
    assert all(files == inodes[1] for files in inodes[1:]), inodes
    assert len(set(used[1:])) == 1, used
    saved = state["w"].clone()
    assert cli.main(["ls", f"--tier=memory={memory_dir}"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("slots on memory: rank 0: 1 free file(s), ")
    runner.close()
    assert not pool_dir(memory_dir, 0).exists(), "close() gives the free file's memory back"
    assert memory.steps() == [12]

    live = {"w": torch.zeros_like(saved), "b": torch.zeros(100)}
    runner = memory_runner(memory_dir)
    runner.register(weights=TensorDictProvider(live))
    assert runner.restore().step == 12
    assert torch.equal(live["w"], saved)
    runner.close()


def test_a_slot_is_resized_when_the_state_grows_and_shrinks(memory_dir: Path) -> None:
    runner = memory_runner(memory_dir)
    provider = {"w": torch.randn(MiB // 4)}
    runner.register(weights=TensorDictProvider(provider))
    memory = FilesystemTier("memory", memory_dir)
    sizes = []
    for step, numel in enumerate([MiB // 4, MiB // 4, 5 * MiB // 4, 5 * MiB // 4, MiB // 8, MiB // 8], start=1):
        if provider["w"].numel() != numel:
            provider["w"] = torch.randn(numel)
        result = runner.checkpoint(step).result()
        sizes.append((result.path / "rank-00000.data").stat().st_size)
        with StoredCheckpoint.locked(result.path) as stored:
            assert torch.equal(stored.read()["weights/w"], provider["w"])
        _pruned_to(memory, [step])
        assert len(_files(memory_dir)) <= 3
    assert sizes[2] > 4 * sizes[0] and sizes[4] < sizes[0]
    assert memory.bytes_used() < 2 * MiB, "the grown slots were shrunk again once taken, not kept at their largest"
    runner.close()


def test_a_state_without_tensor_bytes_and_slots_off_write_as_before(memory_dir: Path, tmp_path: Path) -> None:
    runner = memory_runner(memory_dir)
    runner.register(weights=TensorDictProvider({"e": torch.empty(0)}))
    assert runner.checkpoint(1).result().step == 1
    runner.close()

    off = tmp_path / "off"
    runner = memory_runner(off, slots=False)
    runner.register(weights=TensorDictProvider({"w": torch.randn(1000)}))
    assert runner.checkpoint(1).result().step == 1
    assert not (off / ".slots").exists()
    runner.close()
    with pytest.raises(ConfigError, match=r"tiers\.nvme\.slots: slots are a memory tier's"):
        parse_config({"tiers": {"nvme": {"path": str(tmp_path / "n"), "slots": True}}})


def test_a_failed_checkpoint_gives_its_slot_back(memory_dir: Path) -> None:
    runner = memory_runner(memory_dir)
    tensors = {"w": torch.randn(MiB // 4)}
    runner.register(weights=TensorDictProvider(tensors))
    runner.checkpoint(1).result()

    def fail(_path: Path | None) -> None:
        raise OSError(errno.EIO, "injected")

    with faults.inject("persist.fsync", fail):
        assert runner.checkpoint(2).exception() is not None
    assert len(list(pool_dir(memory_dir, 0).iterdir())) == 1
    assert runner.checkpoint(3).result().step == 3
    runner.close()


def test_capture_into_a_slot_without_its_checksum_is_hashed_by_persist(memory_dir: Path) -> None:
    """What a GPU chunk takes (capture does not hash what a DMA copied): the slot's container hashes it from
    the mapping; here on the CPU, where the mapping is never registered as pinned memory."""
    tensors = {"a": torch.randn(300_000), "b": torch.arange(5000, dtype=torch.int64)}
    plan = plan_checkpoint([TensorItem(k, t) for k, t in tensors.items()], MiB)
    tier = FilesystemTier("memory", memory_dir)
    pool = SlotPool("memory", memory_dir, 0, keep=1, pin=torch.cuda.is_available())
    partial = tier.begin(5)
    layout = SlotLayout.of(plan.chunks, 4096)
    path = data_file_path(partial, 0, "frames")
    slot = pool.take(layout.size, path)
    assert slot.pinned is torch.cuda.is_available()
    windows, copier = SlotWindows(slot, layout, path), SlabCopier()
    chunks = [copier.copy(chunk, windows.take(chunk), None, hash_raw=False) for chunk in plan.chunks]
    assert all(chunk.raw_checksum is None for chunk in chunks)
    shapes = Layout({k: TensorLayout("float32" if k == "a" else "int64", list(t.shape)) for k, t in tensors.items()})
    writer = RankWriter(partial, 0, 5, shapes, container=SlotFile(path, 4096, layout.region(slot)))
    for chunk in chunks:
        writer.write(chunk)
    tier.commit(5, writer.write_index(writer.finish()))
    with StoredCheckpoint.locked(tier.step_dir(5), 5) as stored:
        assert stored.verify() == []
        got = stored.read()
    assert all(torch.equal(got[k], t) for k, t in tensors.items())
    pool.close()
