"""What each rank runs under ``torchrun`` for tests/pipeline/test_fsdp2.py: FSDP2 (``fully_shard``) on gloo, CPU.

Usage: ``torchrun --standalone --nproc_per_node=N tests/fsdp2_worker.py WORKDIR SCENARIO...``.
``train`` runs eight AdamW steps with a checkpoint after the fourth on WORKDIR/tiers/on-N; the
``resume-from-M`` scenarios restore the checkpoint that ``train`` wrote on M ranks into a freshly
built model and optimizer (FSDP2, or a plain module for ``plain-from-M``) and run steps 5 to 8.
Each records under WORKDIR/<scenario>-on-N/rank-R.json what the test compares: the losses, a
digest of the whole state (parameters and optimizer state, gathered), and how the optimizer
state is laid out on this rank.

Every step trains on one sample, the same on every rank. Then no matrix product sums over a batch,
and FSDP2 computes bit-for-bit what one process computes: the uninterrupted run is the same on one
rank and on two, so a resume on another world size must reproduce it exactly too. (With a larger
batch, the gradients of one and two ranks differ in the last bit.)
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dist_worker import Scenario
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from launch import mark_finished
from tierstate.pipeline.runner import Runner
from tierstate.providers import ModuleProvider, ObjectProvider, OptimizerProvider

CHECKPOINT_STEP, LAST_STEP = 4, 8


def make_model(seed: int, sharded: bool) -> nn.Module:
    """Rows that do not split evenly over two ranks (37, 5), and a 1-row layer whose second shard is empty."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 37), nn.Tanh(), nn.Linear(37, 5), nn.Tanh(), nn.Linear(5, 1))
    if sharded:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(1, 12, generator=gen), torch.randn(1, 1, generator=gen)
    loss = (model(x) - y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """A hash of every parameter and optimizer state tensor, whole (collective: every rank calls it)."""
    hasher = hashlib.sha256()
    for param in model.parameters():
        state = opt.state[param]
        for value in [param.detach(), *(state[name] for name in sorted(state))]:
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            hasher.update(whole.reshape(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def layout(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """How each parameter and its optimizer state is held on this rank: type, placements, local shape."""

    def held(tensor: torch.Tensor) -> list:
        if isinstance(tensor, DTensor):
            return ["DTensor", str(tensor.placements), list(tensor.to_local().shape), list(tensor.shape)]
        return ["Tensor", None, list(tensor.shape), list(tensor.shape)]

    return {
        name: {"param": held(param), **{key: held(value) for key, value in opt.state[param].items()}}
        for name, param in model.named_parameters()
    }


def runner_for(s: Scenario, tiers: str, model: nn.Module, opt: torch.optim.Optimizer, counter: dict) -> Runner:
    runner = s.runner(tiers)
    runner.register(
        model=ModuleProvider(model), optim=OptimizerProvider(opt), trainer=ObjectProvider(counter, replicated=True)
    )
    runner.attach(opt)
    return runner


def train(s: Scenario) -> None:
    """The uninterrupted run, with a checkpoint after step 4."""
    model = make_model(seed=0, sharded=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    counter = {"step": 0}
    runner = runner_for(s, f"on-{s.world}", model, opt, counter)
    losses, saved = [], ""
    for step in range(1, LAST_STEP + 1):
        losses.append(train_step(model, opt, step))
        counter["step"] = step
        if step == CHECKPOINT_STEP:
            runner.checkpoint(step)
            saved = digest(model, opt)
    runner.close()
    s.record(losses=losses[CHECKPOINT_STEP:], saved=saved, final=digest(model, opt), layout=layout(model, opt))


def resume(s: Scenario, saved_on: int, sharded: bool) -> None:
    """A new job from other initial weights and no optimizer state: restore, then steps 5 to 8."""
    model = make_model(seed=123, sharded=sharded)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    counter = {"step": -1}
    runner = runner_for(s, f"on-{saved_on}", model, opt, counter)
    result = runner.restore("latest")
    restored, held = digest(model, opt), layout(model, opt)
    losses = [train_step(model, opt, step) for step in range(counter["step"] + 1, LAST_STEP + 1)]
    runner.close()
    s.record(step=result.step, restored=restored, layout=held, losses=losses, final=digest(model, opt))


SCENARIOS: dict[str, Callable[[Scenario], None]] = {
    "train": train,
    "resume-from-1": partial(resume, saved_on=1, sharded=True),
    "resume-from-2": partial(resume, saved_on=2, sharded=True),
    "plain-from-2": partial(resume, saved_on=2, sharded=False),
}


def main() -> None:
    workdir, names = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    for i, name in enumerate(names):
        SCENARIOS[name](Scenario(workdir, f"{name}-on-{dist.get_world_size()}"))
        if i + 1 < len(names):
            dist.barrier()
    mark_finished(workdir, dist.get_rank())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
