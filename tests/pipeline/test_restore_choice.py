"""Which step a restore takes: one process over its tiers, and many ranks over what every rank holds.

The many-rank choice is computed alike on every rank from what all ranks hold; these tests give it
those holdings directly (tests/pipeline/test_distributed.py runs it on real ranks and real tiers).
"""

from __future__ import annotations

import pytest
import torch

from tierstate import NoCheckpointError, NothingToRestoreError, TensorDictProvider
from tierstate.pipeline.dist_restore import _agreed_candidates, _Holdings


def holdings(*per_rank: dict[str, list[int]], which: int | str = "latest", fallback: bool = False) -> list[_Holdings]:
    return [_Holdings(which, fallback, steps, {name: f"/{name}" for name in steps}, {}) for steps in per_rank]


def test_latest_is_the_newest_step_every_rank_holds_on_some_tier() -> None:
    wanted, candidates, problems = _agreed_candidates(holdings({"nvme": [4, 6]}, {"nvme": [4], "pfs": [2, 5]}))
    assert (wanted, candidates) == (4, [4])
    assert problems == [
        "step 5 is not on every rank: rank(s) 0 lack it",
        "step 6 is not on every rank: rank(s) 1 lack it",
    ]


def test_fallback_adds_the_older_steps_every_rank_holds() -> None:
    wanted, candidates, _ = _agreed_candidates(holdings({"nvme": [1, 2, 3, 4]}, {"nvme": [1, 3, 4]}, fallback=True))
    assert (wanted, candidates) == (4, [4, 3, 1])


def test_a_step_one_rank_lacks_fails_on_every_rank_naming_it() -> None:
    with pytest.raises(NoCheckpointError, match=r"cannot restore step 3: step 3 is not on every rank: rank\(s\) 1"):
        _agreed_candidates(holdings({"nvme": [3]}, {"nvme": [2]}, which=3))
    _, candidates, problems = _agreed_candidates(holdings({"nvme": [3, 4]}, {"nvme": [3]}, which=3))
    assert (candidates, problems) == ([3], [])  # a newer step is no concern when step 3 is asked for
    with pytest.raises(NoCheckpointError, match=r"or any older step: .* \(rank 0: nvme=/nvme \[3\]; rank 1"):
        _agreed_candidates(holdings({"nvme": [3]}, {"nvme": [2]}, which=3, fallback=True))
    _, candidates, _ = _agreed_candidates(holdings({"nvme": [2, 3]}, {"nvme": [2]}, which=3, fallback=True))
    assert candidates == [2]


def test_no_step_in_common_and_no_step_at_all_are_told_apart() -> None:
    with pytest.raises(NoCheckpointError, match="no step is committed on a tier of every rank") as failure:
        _agreed_candidates(holdings({"nvme": [3]}, {"nvme": []}))
    assert not isinstance(failure.value, NothingToRestoreError)  # a fresh start would lose step 3
    with pytest.raises(NothingToRestoreError, match="no committed checkpoint on any tier of any rank"):
        _agreed_candidates(holdings({"nvme": []}, {"nvme": [], "pfs": []}))


def test_ranks_that_ask_for_different_restores_all_fail() -> None:
    asked = [*holdings({"nvme": [1]}), *holdings({"nvme": [1]}, which=1)]
    with pytest.raises(ValueError, match=r"rank 0: \('latest', fallback=False\), rank 1: \(1, fallback=False\)"):
        _agreed_candidates(asked)


def test_one_process_with_no_checkpoint_anywhere_raises_nothing_to_restore(make_runner) -> None:
    runner = make_runner()
    runner.register(t=TensorDictProvider({"w": torch.ones(2)}))
    with pytest.raises(NothingToRestoreError, match="no committed checkpoint on any tier"):
        runner.restore("latest")
    with pytest.raises(NoCheckpointError, match="cannot restore step 4: no tier holds it") as failure:
        runner.restore(4)
    assert not isinstance(failure.value, NothingToRestoreError)
