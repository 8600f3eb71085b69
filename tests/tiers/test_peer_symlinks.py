"""A planted ``peer-<node>`` (or ``from-peer-<node>``) symlink inside a tier is never followed: the peer copy
it pretends to be is not listed (so never offered, sent or restored) and nothing is written through it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tierstate import Runner, TensorDictProvider, TierError
from tierstate.tiers.storage.filesystem import FilesystemTier
from tierstate.tiers.storage.peers import kept_for, peer_copies, returned_from


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside the tier holding a valid checkpoint, step 7 (what a forger would plant)."""
    runner = Runner.from_dict({"tiers": {"nvme": {"path": str(tmp_path / "elsewhere")}}})
    runner.register(t=TensorDictProvider({"w": torch.full((8,), 7.0)}))
    runner.checkpoint(7).result()
    runner.close()
    return tmp_path / "elsewhere"


@pytest.mark.parametrize("place", [kept_for, returned_from])
def test_a_planted_peer_symlink_is_neither_listed_nor_written_through(tmp_path: Path, outside: Path, place) -> None:
    tier = FilesystemTier("nvme", tmp_path / "nvme", "node")
    tier.root.mkdir()
    nested = place(tier, "n1")
    assert FilesystemTier("plain", outside).steps() == [7]  # a real checkpoint, out there

    nested.root.symlink_to(outside, target_is_directory=True)
    assert nested.steps() == [] and nested.entries() == []
    assert peer_copies(tier) == []
    with pytest.raises(TierError, match="symlink"):
        nested.begin(8)  # a peer copy arriving for n1: refused, not written into the outside directory
    assert sorted(p.name for p in outside.iterdir() if p.name.startswith("step-")) == ["step-7"]

    nested.root.unlink()  # a real directory in its place is tierstate's own
    shutil.copytree(outside / "step-7", nested.root / "step-7")
    assert nested.steps() == [7]
