"""Background flush NVMe -> PFS during a real training run, with retention on both tiers."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from conftest import REPO
from tierstate import cli
from tierstate.providers import ModuleProvider, ObjectProvider, OptimizerProvider
from tierstate.tiers.ops.pacing import Pacer

TIERED_YAML = REPO / "configs" / "tiered.yaml"


def _train(runner, steps: int) -> tuple[list, torch.nn.Module]:
    """A small model trained ``steps`` steps with a checkpoint after each; the handles and the model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    counters = {"step": 0}
    runner.register(model=ModuleProvider(model), optim=OptimizerProvider(opt), trainer=ObjectProvider(lambda: counters))
    runner.attach(opt)
    handles = []
    for step in range(1, steps + 1):
        model(torch.randn(16, 256)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        counters["step"] = step
        handles.append(runner.checkpoint(step))
    return handles, model


@pytest.fixture
def ls(tmp_path, capsys):
    def run() -> list[dict]:
        options = ["--tier", f"nvme={tmp_path / 'nvme'}", "--tier", f"pfs={tmp_path / 'pfs'}"]
        assert cli.main(["ls", "--json", *options]) == 0
        return json.loads(capsys.readouterr().out)

    return run


def test_training_run_ends_with_every_checkpoint_on_pfs_verified_and_nvme_pruned(
    make_runner, tmp_path, ls, capsys, caplog
):
    caplog.set_level(logging.INFO, logger="tierstate")
    runner = make_runner(
        TIERED_YAML,
        tiers__nvme__retention={"keep_last": 2},
        tiers__pfs__flush={"every": 1, "workers": 1, "bandwidth": "1GB"},
        chunk_size="1MiB",
        host_cache__size="4MiB",
    )
    handles, model = _train(runner, 6)
    final = {k: v.clone() for k, v in model.state_dict().items()}
    runner.close()  # waits for every flush and the retention after it
    assert runner.flush_failures == []
    assert runner.steps() == {"nvme": [5, 6], "pfs": [1, 2, 3, 4, 5, 6]}
    assert all(h.persisted("nvme") and h.persisted("pfs") and not h.flush_errors for h in handles)
    # Never more copies at once than flush.workers (1): each flush to pfs, as its log line dates it (logged
    # when it ended, lasting the seconds it gives), began after the one before it was logged.
    flushes = sorted(
        (r.created - r.args[3], r.created)
        for r in caplog.records
        if r.msg.startswith("step %d flushed to %s") and isinstance(r.args, tuple) and r.args[1] == "pfs"
    )
    assert len(flushes) == 6
    assert all(ended <= began for (_, ended), (began, _) in zip(flushes, flushes[1:], strict=False))
    listed = {(e["tier"], e["step"]): e for e in ls()}
    assert {k: e["state"] for k, e in listed.items() if k[0] == "pfs"} == {("pfs", s): "verified" for s in range(1, 7)}
    assert listed[("nvme", 6)]["flushed"] and listed[("nvme", 6)]["flushed_to"] == ["pfs"]
    assert (
        cli.main(
            ["verify", "--only", "pfs", "--tier", f"nvme={tmp_path / 'nvme'}", "--tier", f"pfs={tmp_path / 'pfs'}"]
        )
        == 0
    )
    assert capsys.readouterr().out.count(": ok (") == 6
    # The PFS copy is a full checkpoint: with NVMe gone, restore takes it.
    restored = make_runner(
        TIERED_YAML, tiers={"nvme": {"path": str(tmp_path / "gone")}, "pfs": {"path": str(tmp_path / "pfs")}}
    )
    _, fresh = _train(restored, 0)
    assert restored.restore("latest").tier == "pfs"
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in final.items())


def test_every_selects_the_steps_the_pfs_receives(make_runner, tmp_path):
    runner = make_runner(TIERED_YAML, tiers__nvme__retention={"keep_last": 2}, tiers__pfs__flush={"every": 2})
    _train(runner, 6)
    runner.close()
    # NVMe lets go of odd steps (no tier is due to hold them) and of even ones once flushed.
    assert runner.steps() == {"nvme": [5, 6], "pfs": [2, 4, 6]}


def test_a_failed_flush_is_reported_and_its_nvme_copy_kept(make_runner, tmp_path, caplog):
    blocker = tmp_path / "pfs-is-a-file"
    runner = make_runner(
        TIERED_YAML,
        tiers={
            "nvme": {"path": str(tmp_path / "nvme"), "retention": {"keep_last": 1}},
            "pfs": {"path": str(blocker), "flush": {}},
        },
    )
    blocker.rmdir()  # a tier path is checked when the runner is built: it goes bad during the run
    blocker.write_text("not a directory")
    handles, _ = _train(runner, 3)
    assert all(h.result().tier == "nvme" for h in handles)  # training and its checkpoints are unaffected
    runner.close()
    assert [(f.step, f.tier) for f in runner.flush_failures] == [(1, "pfs"), (2, "pfs"), (3, "pfs")]
    assert all("pfs" in h.flush_errors and not h.persisted("pfs") for h in handles)
    assert runner.steps()["nvme"] == [1, 2, 3]  # each is the last copy of a checkpoint due on the PFS
    assert "flush of step 2 to tier pfs failed" in caplog.text


def test_config_errors_name_the_key(make_runner):
    with pytest.raises(ValueError, match=r"tiers.nvme.flush: the persist stage writes to 'nvme'"):
        make_runner(TIERED_YAML, tiers__nvme__flush={"every": 1})
    with pytest.raises(ValueError, match=r"tiers.pfs.flush.every: must be greater than or equal to 1, got 0"):
        make_runner(TIERED_YAML, tiers__pfs__flush={"every": 0})
    with pytest.raises(ValueError, match=r"tiers.nvme.retention.keep_lst: unknown key; did you mean 'keep_last'"):
        make_runner(TIERED_YAML, tiers__nvme__retention={"keep_lst": 2})


def test_pacer_keeps_the_average_rate():
    now = [0.0]
    pacer = Pacer(100, clock=lambda: now[0])
    assert pacer.delay(50) == pytest.approx(0.5)  # 50 bytes at 100 B/s: half a second ahead
    now[0] = 2.0
    assert pacer.delay(100) == 0.0  # 150 bytes by t=2 s is under budget
    assert pacer.delay(150) == pytest.approx(1.0)
    assert Pacer(None).delay(10**12) == 0.0
