"""A fresh start on tiers holding an earlier run's checkpoints: refused, or the old run set aside whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierstate import ExistingCheckpointsError, NoCheckpointError, Runner, TensorDictProvider, load


def _runner(root: Path, state: dict[str, torch.Tensor]) -> Runner:
    tiers = {"nvme": {"path": str(root / "nvme")}, "pfs": {"path": str(root / "pfs"), "flush": {"every": 1}}}
    runner = Runner.from_dict({"tiers": tiers, "host_cache": {"size": "16MiB"}})
    runner.register(t=TensorDictProvider(state))
    return runner


def test_a_fresh_start_refuses_or_sets_the_old_run_aside_whole(tmp_path: Path) -> None:
    old = {"w": torch.full((64,), 1.0)}
    with _runner(tmp_path, old) as runner:
        assert runner.start_fresh() == {}  # nothing there: free
        for step in (5, 6):
            runner.checkpoint(step).result()

    new = {"w": torch.full((64,), 2.0)}
    with _runner(tmp_path, new) as runner:
        with pytest.raises(ExistingCheckpointsError, match=r"nvme \(.*\): steps \[5, 6\]; pfs \(.*\): steps \[5, 6\]"):
            runner.start_fresh()
        assert runner.steps() == {"nvme": [5, 6], "pfs": [5, 6]}  # refused: nothing moved

        held = runner.start_fresh(set_aside=True)
        assert sorted(held.values()) == [[5, 6], [5, 6]]
        assert runner.steps() == {"nvme": [], "pfs": []}
        with pytest.raises(NoCheckpointError):
            runner.restore("latest")
        runner.checkpoint(1).result()  # the new run's first checkpoint: no collision, and it is the latest
        runner.restore("latest")
    assert torch.equal(new["w"], torch.full((64,), 2.0))
    for tier in ("nvme", "pfs"):
        [aside] = [p for p in (tmp_path / tier).iterdir() if p.name.startswith("set-aside-")]
        assert sorted(p.name for p in aside.iterdir()) == ["step-5", "step-6"]
        assert torch.equal(load(aside / "step-6")["t/w"], torch.full((64,), 1.0))  # kept, bit-exact
