"""FSDP2 (``fully_shard``) training stopped and resumed on one and on two ranks, for real (gloo, CPU).

Three launches of tests/fsdp2_worker.py: two ranks train and checkpoint; one rank trains and
checkpoints, then resumes the two ranks' checkpoint (into FSDP2 and into a plain module); two ranks
resume both checkpoints. A resumed job starts from other weights and an optimizer without state,
so everything it trains on must come from the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp

from conftest import REPO
from launch import torchrun as launch

WORKER = REPO / "tests" / "fsdp2_worker.py"
LAUNCH_TIMEOUT_S = 180
SHARD_SHAPED = ("exp_avg", "exp_avg_sq")  # AdamW state shaped like its parameter; "step" is a scalar

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"),
    # torch 2.5 (the stated minimum) has FSDP2 only under torch.distributed._composable, and only on CUDA
    pytest.mark.skipif(not hasattr(torch.distributed.fsdp, "fully_shard"), reason="FSDP2 on a CPU needs torch 2.6+"),
]


def torchrun(workdir: Path, ranks: int, *scenarios: str) -> None:
    launch(WORKER, workdir, ranks, scenarios, REPO, LAUNCH_TIMEOUT_S)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("fsdp2")
    torchrun(workdir, 2, "train")
    torchrun(workdir, 1, "train", "resume-from-2", "plain-from-2")
    torchrun(workdir, 2, "resume-from-2", "resume-from-1")
    return workdir


def facts(work: Path, scenario: str, ranks: int) -> list[dict]:
    return [json.loads((work / f"{scenario}-on-{ranks}" / f"rank-{r}.json").read_text()) for r in range(ranks)]


def test_uninterrupted_training_is_the_same_on_one_and_two_ranks(work):
    # The premise of comparing resumes across world sizes (see tests/fsdp2_worker.py).
    (one,), two = facts(work, "train", 1), facts(work, "train", 2)
    for seen in two:
        assert (seen["losses"], seen["saved"], seen["final"]) == (one["losses"], one["saved"], one["final"])


@pytest.mark.parametrize(("saved_on", "resumed_on"), [(2, 2), (2, 1), (1, 2)])
def test_fsdp2_optimizer_state_restores_as_dtensors_holding_this_ranks_part(work, saved_on, resumed_on):
    for rank, seen in enumerate(facts(work, f"resume-from-{saved_on}", resumed_on)):
        for name, held in seen["layout"].items():
            kind, placements, local, whole = held["param"]
            assert kind == "DTensor" and placements == "(Shard(dim=0),)", (rank, name)
            for state in SHARD_SHAPED:
                assert held[state] == held["param"], (rank, name, state)  # same layout, this rank's part only
            assert held["step"][0] == "Tensor", (rank, name)
        parts = {name: held["param"][2] for name, held in seen["layout"].items()}
        if resumed_on == 2:  # uneven rows, and an empty part: the 1-row layer lies on rank 0
            assert parts["0.weight"] == [[19, 12], [18, 12]][rank] and parts["4.weight"] == [[1, 5], [0, 5]][rank]


@pytest.mark.parametrize(("saved_on", "resumed_on"), [(2, 2), (2, 1), (1, 2)])
def test_fsdp2_training_resumes_bit_exactly(work, saved_on, resumed_on):
    (trained, *_) = facts(work, "train", saved_on)
    for rank, seen in enumerate(facts(work, f"resume-from-{saved_on}", resumed_on)):
        assert seen["step"] == 4, rank
        assert seen["restored"] == trained["saved"], rank  # parameters and optimizer state as saved, bit for bit
        assert seen["losses"] == trained["losses"], rank  # exact floats
        assert seen["final"] == trained["final"], rank


def test_fsdp2_checkpoint_restores_into_a_plain_module_as_plain_tensors(work):
    (trained, *_), (seen,) = facts(work, "train", 2), facts(work, "plain-from-2", 1)
    for name, held in seen["layout"].items():
        assert {kind for kind, *_ in held.values()} == {"Tensor"}, name
        assert held["exp_avg"][2] == held["param"][2], name  # the whole tensor
    assert seen["restored"] == trained["saved"] and seen["losses"] == trained["losses"]
    assert seen["final"] == trained["final"]
