"""The small regression net the multi-process workers train (dist_worker, nodes_worker, memory_worker).

One place for its model and its training step, so that each worker's "resumed losses equal the
uninterrupted run's" compares the same computation. Imported by the workers, which run as scripts
from this folder.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def model_and_optimizer(seed: int, width: int, ddp: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``width`` inputs -> ``2 * width`` -> 1, initialised from ``seed`` (DDP-wrapped when ``ddp``), and Adam."""
    torch.manual_seed(seed)
    model: nn.Module = nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, 1))
    if ddp:
        model = DistributedDataParallel(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    """One step learning the sum of ``x``'s features; the loss."""
    loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()
