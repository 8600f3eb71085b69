"""Optimizer state of DTensor parameters (FSDP2) in one process: a one-rank gloo group and device mesh.

Many ranks, resharding and world-size changes run for real in tests/pipeline/test_fsdp2.py (slow); these
check, fast, what one rank decides: which saved tensors take their parameter's layout, and that
the optimizer gets DTensors back whether it is fresh or already holds state.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from test_providers import read_back
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch 2.5 (the stated minimum) has FSDP2 only under _composable, and only on CUDA
    pytest.skip("FSDP2 on the CPU needs torch >= 2.6", allow_module_level=True)
from torch.distributed.tensor import DTensor

from tierstate.providers import CompositeProvider, ModuleProvider, OptimizerProvider, RestoreError, ShardInfo

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")


@pytest.fixture(scope="module")
def mesh() -> Iterator:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def sharded_model(mesh, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        loss = (model(torch.randn(1, 6, generator=gen)) - torch.randn(1, 2, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def assert_laid_out_like_params(opt: torch.optim.Optimizer) -> None:
    for param, state in opt.state.items():
        for name in ("exp_avg", "exp_avg_sq"):
            value = state[name]
            assert isinstance(value, DTensor), name
            assert (value.placements, value.device_mesh) == (param.placements, param.device_mesh), name
            assert value.shape == param.shape and value.to_local().shape == param.to_local().shape, name
        assert not isinstance(state["step"], DTensor)


def test_fresh_optimizer_restores_dtensor_state_and_trains_on_bit_exactly(mesh, make_runner):
    model = sharded_model(mesh, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, range(3))
    with make_runner() as runner:
        runner.register(model=ModuleProvider(model), optim=OptimizerProvider(opt))
        runner.checkpoint(3).result()
    want = train(model, opt, range(3, 6))

    fresh = sharded_model(mesh, seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    with make_runner() as runner:
        runner.register(model=ModuleProvider(fresh), optim=OptimizerProvider(fresh_opt))
        runner.restore("latest")
    assert_laid_out_like_params(fresh_opt)
    assert train(fresh, fresh_opt, range(3, 6)) == want


def test_restore_into_live_dtensor_state_copies_into_it(mesh):
    model = sharded_model(mesh, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, range(2))
    provider = OptimizerProvider(opt)
    state = read_back(provider.describe())
    live = [opt.state[p]["exp_avg"] for p in model.parameters()]
    train(model, opt, range(2, 4))  # the state moves on; the rollback brings it back, in the same memory

    provider.restore(state)
    assert_laid_out_like_params(opt)
    assert all(opt.state[p]["exp_avg"] is old for p, old in zip(model.parameters(), live, strict=True))
    for item in provider.describe():
        if item.key in state and item.key != "skeleton":
            assert torch.equal(item.tensor, state[item.key]), item.key


def test_only_state_shaped_like_a_dtensor_parameter_gets_its_layout(mesh):
    model = sharded_model(mesh, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saved = {"state/0/exp_avg": (5, 6), "state/0/step": (), "state/1/exp_avg": (7,), "state/9/exp_avg": (5,)}
    targets = OptimizerProvider(opt).restore_targets(saved)
    assert list(targets) == ["state/0/exp_avg"]  # not step, not another shape, not a parameter it lacks
    target = targets["state/0/exp_avg"]
    assert target.shard == ShardInfo((5, 6), (0, 0)) and target.tensor.device.type == "meta"
    composite = CompositeProvider(optim=OptimizerProvider(opt))
    nested = composite.restore_targets({f"optim/{key}": shape for key, shape in saved.items()})
    assert [(key, target.key) for key, target in nested.items()] == [("optim/state/0/exp_avg",) * 2]
    plain = torch.optim.AdamW(nn.Linear(6, 5).parameters())
    assert OptimizerProvider(plain).restore_targets(saved) == {}


def test_a_value_that_is_not_this_ranks_part_is_refused(mesh):
    model = sharded_model(mesh, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, range(1))
    state = read_back(OptimizerProvider(opt).describe())
    fresh_opt = torch.optim.AdamW(sharded_model(mesh, seed=1).parameters(), lr=1e-2)
    fresh = OptimizerProvider(fresh_opt)
    fresh.restore_targets({"state/0/exp_avg": (5, 6)})  # this rank was to read its part of it
    with pytest.raises(RestoreError, match=r"'state/0/exp_avg'.*part of shape \[5, 6\].*has shape \[30\]"):
        fresh.restore({**state, "state/0/exp_avg": torch.zeros(30)})
