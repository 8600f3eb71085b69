"""Two ranks under torchrun save one tierstate checkpoint for tests/integrations/test_dcp.py (gloo, CPU).

Usage: ``torchrun --standalone --nproc_per_node=2 dcp_worker.py WORKDIR`` (tests/launch.py's torchrun).
A replicated model and optimizer (the same on both ranks, from fixed seeds) and a row-sharded tensor
``shards/w`` (rank 0 rows 0-3, rank 1 rows 4-6), committed as step 1 on the tier ``WORKDIR/nvme``; then
the same state saved by ``dcp.save`` into ``WORKDIR/titan``, the tensor as a DTensor sharded by rows (as
FSDP2 / TorchTitan save). The test rebuilds the values from :func:`expected`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from launch import mark_finished
from tierstate import ModuleProvider, OptimizerProvider, Runner, ShardInfo, TensorItem

SHAPE = (7, 5)


def expected() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """The model and optimizer after one step, and the whole sharded tensor, as every rank holds them."""
    torch.manual_seed(3)
    model = torch.nn.Linear(5, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 5)).square().sum().backward()
    optimizer.step()
    return model, optimizer, torch.randn(SHAPE, dtype=torch.float64)


def rows(rank: int) -> tuple[int, int]:
    return (0, 4) if rank == 0 else (4, 7)


class RowShard:
    """This rank's rows of ``w``, described with a ShardInfo."""

    def __init__(self, rank: int, whole: torch.Tensor) -> None:
        self.start, end = rows(rank)
        self.tensor = whole[self.start : end].clone()

    def describe(self) -> list[TensorItem]:
        return [TensorItem("w", self.tensor, shard=ShardInfo(SHAPE, (self.start, 0)))]

    def restore(self, state: dict) -> None:
        self.tensor.copy_(state["w"])


def main(workdir: Path) -> None:
    dist.init_process_group("gloo")
    model, optimizer, whole = expected()
    runner = Runner.from_dict({"tiers": {"nvme": {"path": str(workdir / "nvme")}}})
    runner.register(
        model=ModuleProvider(model, replicated=True),
        optim=OptimizerProvider(optimizer, replicated=True),
        shards=RowShard(dist.get_rank(), whole),
    )
    runner.checkpoint(1).result()
    runner.close()

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = distribute_tensor(whole, mesh, [Shard(0)])
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "shards": {"w": sharded}}
    dcp.save(state, checkpoint_id=str(workdir / "titan"))
    mark_finished(workdir, dist.get_rank())
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
