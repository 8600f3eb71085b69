"""Which step a restore takes: one process over its tiers, and many ranks over what every rank holds.

The many-rank choice is computed alike on every rank from what all ranks hold; these tests give it
those holdings directly (tests/pipeline/test_distributed.py runs it on real ranks and real tiers).
"""

from __future__ import annotations

import pytest
import torch

from tierstate import NoCheckpointError, NothingToRestoreError, TensorDictProvider
from tierstate.pipeline.agreement import Holdings, agreed_candidates, restore_checkpoint
from tierstate.pipeline.runner import Runner
from tierstate.pipeline.solo import SoloGroup
from tierstate.providers.composite import CompositeProvider
from tierstate.tiers.storage.filesystem import FilesystemTier


def holdings(*per_rank: dict[str, list[int]], which: int | str = "latest", fallback: bool = False) -> list[Holdings]:
    return [Holdings(which, fallback, steps, {name: f"/{name}" for name in steps}, {}) for steps in per_rank]


def test_latest_is_the_newest_step_every_rank_holds_on_some_tier() -> None:
    wanted, candidates, problems = agreed_candidates(holdings({"nvme": [4, 6]}, {"nvme": [4], "pfs": [2, 5]}))
    assert (wanted, candidates) == (4, [4])
    assert problems == [
        "step 5 is not on every rank: rank(s) 0 lack it",
        "step 6 is not on every rank: rank(s) 1 lack it",
    ]


def test_fallback_adds_the_older_steps_every_rank_holds() -> None:
    wanted, candidates, _ = agreed_candidates(holdings({"nvme": [1, 2, 3, 4]}, {"nvme": [1, 3, 4]}, fallback=True))
    assert (wanted, candidates) == (4, [4, 3, 1])


def test_a_step_one_rank_lacks_fails_on_every_rank_naming_it() -> None:
    with pytest.raises(NoCheckpointError, match=r"cannot restore step 3: step 3 is not on every rank: rank\(s\) 1"):
        agreed_candidates(holdings({"nvme": [3]}, {"nvme": [2]}, which=3))
    _, candidates, problems = agreed_candidates(holdings({"nvme": [3, 4]}, {"nvme": [3]}, which=3))
    assert (candidates, problems) == ([3], [])  # a newer step is no concern when step 3 is asked for
    with pytest.raises(NoCheckpointError, match=r"or any older step: .* \(rank 0: nvme=/nvme \[3\]; rank 1"):
        agreed_candidates(holdings({"nvme": [3]}, {"nvme": [2]}, which=3, fallback=True))
    _, candidates, _ = agreed_candidates(holdings({"nvme": [2, 3]}, {"nvme": [2]}, which=3, fallback=True))
    assert candidates == [2]


def test_no_step_in_common_and_no_step_at_all_are_told_apart() -> None:
    with pytest.raises(NoCheckpointError, match="no step is committed on a tier of every rank") as failure:
        agreed_candidates(holdings({"nvme": [3]}, {"nvme": []}))
    assert not isinstance(failure.value, NothingToRestoreError)  # a fresh start would lose step 3
    with pytest.raises(NothingToRestoreError, match="no committed checkpoint on any tier of any rank"):
        agreed_candidates(holdings({"nvme": []}, {"nvme": [], "pfs": []}))


def test_ranks_that_ask_for_different_restores_all_fail() -> None:
    asked = [*holdings({"nvme": [1]}), *holdings({"nvme": [1]}, which=1)]
    with pytest.raises(ValueError, match=r"rank 0: \('latest', fallback=False\), rank 1: \(1, fallback=False\)"):
        agreed_candidates(asked)


def test_one_process_with_no_checkpoint_anywhere_raises_nothing_to_restore(make_runner) -> None:
    runner = make_runner()
    runner.register(t=TensorDictProvider({"w": torch.ones(2)}))
    with pytest.raises(NothingToRestoreError, match="no committed checkpoint on any tier"):
        runner.restore("latest")
    with pytest.raises(NoCheckpointError, match="cannot restore step 4: no tier holds it") as failure:
        runner.restore(4)
    assert not isinstance(failure.value, NothingToRestoreError)


# --- one path: a process alone is a group of one ---------------------------------------------------


def test_a_process_alone_is_a_group_of_one_whose_collectives_are_the_identity() -> None:
    group = SoloGroup()
    assert (group.rank, group.world_size, group.node_ranks) == (0, 1, [0])
    assert group.all_gather({"a": 1}, "what") == [{"a": 1}] and group.node_all_gather(2, "what") == [2]
    sent = torch.arange(4.0)
    group.broadcast(sent, 0, "what")
    group.node_broadcast(sent, 0, "what")
    assert torch.equal(sent, torch.arange(4.0))


LOST = ((5, "step 5 on tier nvme: not a checkpoint: no manifest"),)


@pytest.mark.parametrize("ranks", [1, 2])
def test_one_rule_for_one_rank_and_many_a_damaged_newest_step_is_refused_not_skipped(ranks: int) -> None:
    # The same agreement decides for one process (its holdings alone) as for many: a newest step that lost
    # its manifest is refused; with fallback it is passed over and named.
    held = [Holdings("latest", False, {"nvme": [3]}, {"nvme": "/nvme"}, {}, LOST) for _ in range(ranks)]
    prefix = "" if ranks == 1 else "rank 0: "
    with pytest.raises(NoCheckpointError, match=f"cannot restore the latest step: {prefix}step 5 on tier nvme"):
        agreed_candidates(held)
    held = [Holdings("latest", True, {"nvme": [3]}, {"nvme": "/nvme"}, {}, LOST) for _ in range(ranks)]
    wanted, candidates, problems = agreed_candidates(held)
    assert (wanted, candidates) == (3, [3])
    assert problems[0] == f"{prefix}step 5 on tier nvme: not a checkpoint: no manifest"


@pytest.mark.parametrize("ranks", [1, 2])
def test_no_checkpoint_but_damaged_ones_is_no_fresh_start_on_one_rank_or_many(ranks: int) -> None:
    held = [Holdings("latest", False, {"nvme": []}, {"nvme": "/nvme"}, {}, LOST) for _ in range(ranks)]
    with pytest.raises(NoCheckpointError, match="no usable checkpoint on any tier") as failure:
        agreed_candidates(held)
    assert not isinstance(failure.value, NothingToRestoreError)  # a fresh start would silently lose step 5


def test_a_process_alone_restores_through_the_same_rounds_a_damaged_copy_sends_it_to_the_next(tmp_path) -> None:
    # restore_checkpoint on a group of one: the copy on the first tier fails its checksums, the rank moves
    # on to its next copy of the same step, and the problem is named as the rounds name it.
    tiers = [FilesystemTier(name, tmp_path / name) for name in ("nvme", "pfs")]
    for tier in tiers:
        runner = Runner.from_dict({"tiers": {tier.name: {"path": str(tier.root)}}})
        runner.register(t=TensorDictProvider({"w": torch.arange(1000.0)}))
        runner.checkpoint(2).result()
        runner.close()
    data = tiers[0].step_dir(2) / "rank-00000.data"
    frame = tiers[0].manifest(2).files["rank-00000.data"].frames[0]
    raw = bytearray(data.read_bytes())
    raw[frame.offset + frame.length // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    live = {"w": torch.zeros(1000)}
    result = restore_checkpoint(SoloGroup(), CompositeProvider(t=TensorDictProvider(live)), tiers, "latest", False)
    assert (result.step, result.tier, result.tier_by_rank) == (2, "pfs", ("pfs",))
    assert torch.equal(live["w"], torch.arange(1000.0))
    assert len(result.problems) == 1 and result.problems[0].startswith("step 2 on tier nvme: ")
    assert "checksum mismatch" in result.problems[0]
