"""restore("latest") on many ranks follows the one-rank rule for a newer step that lost its manifest.

Every rank sends what its tiers hold (``Holdings.of``, real tiers on disk) and every rank decides
from the same gathered list (``agreed_candidates``), so here the holdings of two ranks are built
from two real tier directories and decided on as each rank would, without processes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tierstate.pipeline.agreement import Holdings, agreed_candidates
from tierstate.pipeline.restore import NoCheckpointError
from tierstate.providers import TensorDictProvider
from tierstate.tiers.storage.filesystem import FilesystemTier


def _two_ranks_tiers(make_runner, tmp_path: Path) -> tuple[list[FilesystemTier], list[FilesystemTier]]:
    runner = make_runner()
    runner.register(model=TensorDictProvider({"w": torch.ones(4)}))
    runner.checkpoint(1).result()
    runner.checkpoint(2).result()
    tiers = list(runner.tiers)
    newest = tiers[0].step_dir(2)
    (newest / "manifest.json").unlink()  # rank 0's newest step lost its manifest
    other = FilesystemTier("nvme", tmp_path / "other")  # rank 1 holds step 1 only
    other.root.mkdir()
    shutil.copytree(tiers[0].step_dir(1), other.root / "step-1")
    return [tiers[0]], [other]


def test_a_lost_newer_step_on_any_rank_is_refused_without_fallback(make_runner, tmp_path: Path) -> None:
    rank0, rank1 = _two_ranks_tiers(make_runner, tmp_path)
    holdings = [Holdings.of(rank0, (), "latest", False), Holdings.of(rank1, (), "latest", False)]
    with pytest.raises(NoCheckpointError, match=r"cannot restore the latest step: rank 0: step 2 on tier nvme"):
        agreed_candidates(holdings)  # before: step 1 was taken, step 2 named only in problems


def test_with_fallback_the_older_step_is_taken_and_the_lost_one_reported(make_runner, tmp_path: Path) -> None:
    rank0, rank1 = _two_ranks_tiers(make_runner, tmp_path)
    holdings = [Holdings.of(rank0, (), "latest", True), Holdings.of(rank1, (), "latest", True)]
    wanted, candidates, problems = agreed_candidates(holdings)
    assert (wanted, candidates) == (1, [1])
    assert any(p.startswith("rank 0: step 2 on tier nvme: not a checkpoint") for p in problems)
