"""PyTorch DCP both ways: tierstate export --format dcp, tierstate import; every tensor bit-exact."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from launch import torchrun
from tierstate import ObjectProvider, RNGProvider, Runner, StatefulProvider, TensorDictProvider
from tierstate.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")

HERE = Path(__file__).parent
REPO = HERE.parents[1]


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, steps: int) -> list[float]:
    gen = torch.Generator().manual_seed(11)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(6, 4, generator=gen)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses


def assert_same_training_state(a: tuple, b: tuple) -> None:
    (ma, oa, sa), (mb, ob, sb) = a, b
    for (key, x), y in zip(ma.state_dict().items(), mb.state_dict().values(), strict=True):
        assert torch.equal(x, y), key
    for pa, pb in zip(ma.parameters(), mb.parameters(), strict=True):
        assert oa.state[pa].keys() == ob.state[pb].keys()
        for name, value in oa.state[pa].items():
            assert torch.equal(value, ob.state[pb][name]), name
    assert oa.state_dict()["param_groups"] == ob.state_dict()["param_groups"]
    assert sa.state_dict() == sb.state_dict()


class Counters:
    """A Stateful, as TorchTitan's train state is."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def test_export_loads_with_dcp_and_imports_back_bit_exact(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    saved = build()
    train(*saved, 3)
    counters = {"step": 3}
    rng = torch.get_rng_state()
    with Runner.from_dict({"tiers": {"nvme": {"path": str(tmp_path / "nvme")}}}) as runner:
        model, optimizer, scheduler = saved
        runner.register(model=model, optim=optimizer, sched=scheduler)
        runner.register(rng=RNGProvider(), trainer=ObjectProvider(counters))
        runner.checkpoint(3).result()
    out = tmp_path / "dcp"
    assert main(["export", "3", str(out), "--format", "dcp", "--tier", f"nvme={tmp_path / 'nvme'}"]) == 0

    # Every value, without a template; integer keys of the optimizer state became strings, as DCP does.
    everything = _load_state_dict_from_keys(checkpoint_id=str(out))
    assert sorted(everything) == ["model", "optim", "rng", "sched", "trainer"]
    for key, value in model.state_dict().items():
        assert torch.equal(everything["model"][key], value), key
    assert everything["trainer"] == counters and everything["sched"] == scheduler.state_dict()
    assert torch.equal(everything["rng"]["torch"], rng)

    # Into the usual state dicts of a fresh model and optimizer (its state made by one step).
    fresh = build(seed=5)
    train(*fresh, 1)
    template = {"model": fresh[0].state_dict(), "optim": fresh[1].state_dict(), "sched": fresh[2].state_dict()}
    dcp.load(template, checkpoint_id=str(out))
    fresh[0].load_state_dict(template["model"])
    fresh[1].load_state_dict(template["optim"])
    fresh[2].load_state_dict(template["sched"])
    assert_same_training_state(saved, fresh)

    # And back: the export imported as step 9 of another tier restores into the usual providers.
    capsys.readouterr()
    assert main(["import", str(out), "--to", "pfs", "--step", "9", "--tier", f"pfs={tmp_path / 'pfs'}"]) == 0
    assert "model (flat), optim (stateful), rng (flat), sched (stateful), trainer (value)" in capsys.readouterr().out
    back, restored_counters = build(seed=6), {}
    torch.manual_seed(123)
    with Runner.from_dict({"tiers": {"pfs": {"path": str(tmp_path / "pfs")}}}) as runner:
        runner.register(model=back[0], optim=back[1], sched=back[2])
        runner.register(rng=RNGProvider(), trainer=ObjectProvider(restored_counters))
        assert runner.restore("latest").step == 9
    assert_same_training_state(saved, back)
    assert restored_counters == counters and torch.equal(torch.get_rng_state(), rng)
    assert train(*saved, 3) == train(*back, 3)  # and training goes on the same


def test_import_of_a_torchtitan_style_dcp_save_continues_training_exactly(tmp_path: Path) -> None:
    source = build()
    train(*source, 2)
    model, optimizer, scheduler = source
    state = {**model.state_dict(), "optimizer": optimizer.state_dict(), "lr_scheduler": scheduler.state_dict()}
    state["train_state"] = {"step": 2}  # TorchTitan: the model's tensors at the top level, beside the rest
    dcp.save(state, checkpoint_id=str(tmp_path / "titan"))
    tier = f"nvme={tmp_path / 't'}"
    assert main(["import", str(tmp_path / "titan"), "--to", "nvme", "--step", "2", "--tier", tier]) == 0

    target, counters = build(seed=9), Counters()
    with Runner.from_dict({"tiers": {"nvme": {"path": str(tmp_path / "t")}}}) as runner:
        runner.register(
            model=target[0], optimizer=target[1], lr_scheduler=target[2], train_state=StatefulProvider(counters)
        )
        runner.restore(2)
    assert counters.step == 2
    assert_same_training_state(source, target)
    assert train(*source, 3) == train(*target, 3)


def test_objects_that_need_pickle_are_refused_unless_allowed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    dcp.save({"model": {"w": torch.ones(2)}, "blob": io.BytesIO(b"opaque")}, checkpoint_id=str(tmp_path / "d"))
    tier = f"nvme={tmp_path / 't'}"
    assert main(["import", str(tmp_path / "d"), "--to", "nvme", "--step", "1", "--tier", tier]) == 1
    assert "needs pickle to load" in capsys.readouterr().err
    assert main(["import", str(tmp_path / "d"), "--to", "nvme", "--step", "1", "--tier", tier, "--allow-pickle"]) == 0


@pytest.mark.slow
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_two_rank_saves_both_ways_shards_as_dcp_chunks_and_dtensor_chunks_imported(tmp_path: Path) -> None:
    tiers, titan = tmp_path / "nvme", tmp_path / "titan"  # where the worker writes
    torchrun(HERE / "dcp_worker.py", tmp_path, 2, (), REPO, 180)
    out = tmp_path / "dcp"
    assert main(["export", "1", str(out), "--format", "dcp", "--tier", f"nvme={tiers}"]) == 0

    from dcp_worker import SHAPE, expected  # beside this file: pytest puts its folder on sys.path
    model, optimizer, whole = expected()
    chunks = dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata["shards.w"].chunks
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks) == [((0, 0), (4, 5)), ((4, 0), (3, 5))]

    template = {"shards": {"w": torch.zeros(SHAPE, dtype=torch.float64)}, "model": build_linear().state_dict()}
    dcp.load(template, checkpoint_id=str(out))  # one process, no process group: the chunks make one tensor
    assert torch.equal(template["shards"]["w"], whole)
    for key, value in model.state_dict().items():
        assert torch.equal(template["model"][key], value), key
    everything = _load_state_dict_from_keys(checkpoint_id=str(out))
    for param_index, param in enumerate(model.parameters()):
        for name, value in optimizer.state[param].items():
            assert torch.equal(everything["optim"]["state"][str(param_index)][name], value), name

    # The other way: DCP's own 2-rank save (a DTensor in two chunks) imported, and restored in one process.
    assert len(dcp.FileSystemReader(str(titan)).read_metadata().state_dict_metadata["shards.w"].chunks) == 2
    assert main(["import", str(titan), "--to", "pfs", "--step", "1", "--tier", f"pfs={tmp_path / 'pfs'}"]) == 0
    target, w = build_linear(), torch.zeros(SHAPE, dtype=torch.float64)
    target_optimizer = torch.optim.AdamW(target.parameters(), lr=0.1)
    with Runner.from_dict({"tiers": {"pfs": {"path": str(tmp_path / "pfs")}}}) as runner:
        runner.register(model=target, optim=target_optimizer, shards=TensorDictProvider({"w": w}))
        runner.restore(1)
    assert torch.equal(w, whole)
    for (key, value), restored in zip(model.state_dict().items(), target.state_dict().values(), strict=True):
        assert torch.equal(restored, value), key
    for param, restored in zip(model.parameters(), target.parameters(), strict=True):
        for name, value in optimizer.state[param].items():
            assert torch.equal(target_optimizer.state[restored][name], value), name


def build_linear() -> torch.nn.Module:
    return torch.nn.Linear(5, 3)


class _RunsCode:
    """A forged DCP .metadata: unpickling it calls ``open(marker, "w")``, i.e. runs code of the file's choosing."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


def test_a_forged_dcp_metadata_is_never_unpickled(tmp_path: Path) -> None:
    source = tmp_path / "forged"
    dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=str(source))
    marker = tmp_path / "code-ran"
    import pickle

    (source / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    command = [sys.executable, "-m", "tierstate", "import", str(source), "--to", "nvme", "--step", "1"]
    done = subprocess.run(
        [*command, "--tier", f"nvme={tmp_path / 't'}"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert not marker.exists(), "the forged .metadata ran code"
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # one line, no traceback logged by torch
    assert ".metadata: refused: it names io.open" in lines[0] and "--allow-pickle" in lines[0]
    assert not (tmp_path / "t" / "step-1").exists()


def test_dcp_metadata_of_real_saves_reads_through_the_restricted_unpickler(tmp_path: Path) -> None:
    model, optimizer, scheduler = build()
    train(model, optimizer, scheduler, 1)
    state = {
        "model": {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "s": scheduler.state_dict(),
        "extra": {"ints": [1, 2], "f": 0.5, "name": "x", "none": None, "i8": torch.arange(3, dtype=torch.int8)},
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "d"))
    tier = f"nvme={tmp_path / 't'}"
    assert main(["import", str(tmp_path / "d"), "--to", "nvme", "--step", "1", "--tier", tier]) == 0


def _hf_schedule(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """A model, AdamW and transformers' linear warmup schedule: a LambdaLR over a functools.partial,
    whose state dict holds ``lr_lambdas: [{}]``, which DCP drops (it keeps no empty container)."""
    from transformers import get_linear_schedule_with_warmup

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, get_linear_schedule_with_warmup(optimizer, 2, 10)


@pytest.mark.parametrize("route", ["dcp.save", "export"])
def test_an_hf_lambda_schedule_imports_from_dcp_and_trains_on_alike(tmp_path: Path, route: str) -> None:
    saved = _hf_schedule(0)
    train(*saved, 3)
    assert saved[2].state_dict()["lr_lambdas"] == [{}]
    model, optimizer, scheduler = saved
    if route == "dcp.save":
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        dcp.save({**state, "lr_scheduler": scheduler.state_dict()}, checkpoint_id=str(tmp_path / "d"))
    else:  # tierstate's own export -> import round trip
        with Runner.from_dict({"tiers": {"nvme": {"path": str(tmp_path / "nvme")}}}) as runner:
            runner.register(model=model, optimizer=optimizer, lr_scheduler=scheduler)
            runner.checkpoint(3).result()
        assert main(["export", "3", str(tmp_path / "d"), "--format", "dcp", "--tier", f"nvme={tmp_path / 'nvme'}"]) == 0
    assert main(["import", str(tmp_path / "d"), "--to", "pfs", "--step", "3", "--tier", f"pfs={tmp_path / 'pfs'}"]) == 0

    back = _hf_schedule(7)
    with Runner.from_dict({"tiers": {"pfs": {"path": str(tmp_path / "pfs")}}}) as runner:
        runner.register(model=back[0], optimizer=back[1], lr_scheduler=back[2])
        assert runner.restore("latest").step == 3
    assert back[2].state_dict() == scheduler.state_dict()
    assert train(*saved, 4) == train(*back, 4)
